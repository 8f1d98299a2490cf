"""load_model(path_or_none, dtype): a Hugging Face directory, a .gguf file, or (None) the default model."""

from __future__ import annotations

import contextlib
import gc
import glob
import logging
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.dtypes import resolve_dtype
from pagedllm.model import registry
from pagedllm.model import tokenizer as tokenization
from pagedllm.model.config import ModelConfig, check_token_ids
from pagedllm.model.embedded import default_model_path
from pagedllm.model.errors import InvalidModelError
from pagedllm.model.gguf_reader import open_regular_file
from pagedllm.model.weight_loading import load_weights
from pagedllm.quantization import QUANTIZATION

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module  # the registry's model class for the architecture
    config: ModelConfig
    tokenizer: tokenization.Tokenizer | None  # with the chat template (None if the checkpoint has no tokenizer)
    name: str
    eos_token_ids: list[int]
    dtype: torch.dtype = torch.float32
    path: str = ""
    sampling_defaults: dict[str, Any] | None = None  # a GGUF file's general.sampling.* (read in the one parse)

    def check_token_ids(self, token_ids: list[int]) -> None:
        """ValueError if any id is outside the model's vocabulary."""
        check_token_ids(token_ids, self.config.vocab_size)


def gguf_model_name(path: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct': the id clients use, without the quantisation."""
    stem = os.path.basename(path).removesuffix(".gguf")
    return re.sub(r"[.-](Q\d\w*|IQ\d\w*|F16|BF16|F32)$", "", stem, flags=re.IGNORECASE) or stem





def load_model(path: str | None = None, dtype: str | torch.dtype = "float32",
               attention_backend: str = "auto", load_tokenizer: bool = True,
               quantization: str = "auto") -> LoadedModel:
    """quantization: "auto" runs GGUF block formats as stored where the kernels have VNNI ("gguf": on every CPU;
    HF checkpoints as stored, i.e. dense), "none"
    dequantizes everything to `dtype` (the oracle), "int8" quantizes HF float weights to int8 blocks at load."""
    if quantization not in QUANTIZATION:
        raise ValueError(f"quantization must be one of {', '.join(map(repr, QUANTIZATION))}, got {quantization!r}")
    t0 = time.perf_counter()
    if path is None:
        path = default_model_path()
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path} (give a Hugging Face directory with "
                                f"config.json + *.safetensors, or a .gguf file)")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:  # a directory holding just one GGUF file: load that
            path = ggufs[0]
        elif ggufs:
            raise ValueError(f"{path} holds several .gguf files; pass one of them: {[os.path.basename(g) for g in ggufs]}")
    try:
        with _gc_paused():
            if os.path.isdir(path):
                loaded = _load_hf(path, dtype, attention_backend, load_tokenizer, quantization)
            elif path.endswith(".gguf") or _has_gguf_magic(path):
                loaded = _load_gguf(path, dtype, attention_backend, load_tokenizer, quantization)
            else:
                raise ValueError(f"{path} is neither a directory nor a .gguf file")
    except InvalidModelError as e:
        e.with_path(path)  # config parsing raises before it knows the file
        raise
    logger.info("loaded %s (%s, %s) in %.2f s", loaded.name, loaded.config.architecture,
                str(loaded.dtype).replace("torch.", ""), time.perf_counter() - t0)
    return loaded


def _has_gguf_magic(path: str) -> bool:
    with os.fdopen(open_regular_file(path), "rb") as f:  # (a FIFO would block a plain open)
        return f.read(4) == b"GGUF"


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cycle collection while a model loads: a file's metadata and vocabulary (150k-token lists and dicts) make
    many container objects, each gen-0 threshold of them a collection, and the full ones walk all of torch's
    objects too. Loading makes little cyclic garbage; reference counts free the rest."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _build(cfg: ModelConfig, dtype: torch.dtype, weights, table: dict, attention_backend: str,
           linear_method=None, source: str = "") -> nn.Module:
    """The registry's model class for cfg, with the checkpoint's weights put in through `table` (a weight the
    model has no place for, of the wrong shape, or missing is an InvalidModelError naming `source`)."""
    kw = {} if linear_method is None else {"linear_method": linear_method}
    model = registry.spec(cfg.architecture).model_cls()(cfg, dtype, attention_backend, **kw)
    # All threads: the repack's page faults are most of a load on a VM (the host backs each fresh page), and they
    # run in parallel, even beside other busy processes (BENCHMARKS.md, issue 29).
    with torch.no_grad():
        try:
            load_weights(model, weights, table, cfg.num_layers, cfg.num_experts)
        except InvalidModelError:
            raise
        except ValueError as e:
            raise InvalidModelError(str(e), path=source) from e
    return model.eval()


def _quantized_method(quantize_floats: bool, dense_bytes: int | None = None):
    """The quantized LinearMethod, or None (dense weights) where the kernel cannot be built here. `dense_bytes`
    (a GGUF file under "auto"): what its weights take dequantized to bf16; where the build has no vector int8
    products (neither VNNI nor AVX2: the portable code, far slower there than dense bf16: README, Quantized weights)
    and they fit in half the memory available, the weights are dequantized instead."""
    from pagedllm.kernels.dispatch import INT8_GEMM, has
    from pagedllm.model.quantized_linear import QuantizedLinearMethod
    from pagedllm.quantization.tensor import kernel_available

    if not kernel_available():
        logger.warning("the quantized GEMM kernel is not available: weights are dequantized (quantization='none')")
        return None
    if dense_bytes is not None and not has(INT8_GEMM):
        import psutil

        if dense_bytes < psutil.virtual_memory().available // 2:
            logger.warning("this CPU's kernels have no vector int8 products: the weights are dequantized "
                           "(%.1f GB in bf16), faster here than as stored", dense_bytes / 1e9)
            return None
    return QuantizedLinearMethod(quantize_floats)


def _load_hf(path: str, dtype: str | torch.dtype, attention_backend: str, load_tokenizer: bool,
             quantization: str) -> LoadedModel:
    from pagedllm.model import hf_loader

    cfg, raw = hf_loader.read_hf_config(path)
    spec = registry.spec(cfg.architecture)
    # a checkpoint in blocks (gpt-oss's MXFP4 experts) runs as stored unless told "none"
    blocks = hf_loader.stored_quantization(raw, path) is not None and quantization != "none"
    method = (_quantized_method(quantize_floats=quantization == "int8") if quantization == "int8" or blocks
              else None)
    tdtype = resolve_dtype(dtype, quantized=method is not None)
    tok = hf_loader.load_hf_tokenizer(path) if load_tokenizer else None  # first: see _load_gguf
    weights = spec.adapt_hf_weights(hf_loader.iter_hf_weights(path), as_stored=method is not None)
    model = _build(cfg, tdtype, weights, spec.hf_names, attention_backend, method, path)
    _fill_eos_from_tokenizer(cfg, tok)
    return LoadedModel(model, cfg, tok, os.path.basename(os.path.normpath(path)), cfg.eos_token_ids, tdtype, path)


def _load_gguf(path: str, dtype: str | torch.dtype, attention_backend: str, load_tokenizer: bool,
               quantization: str) -> LoadedModel:
    """The file is parsed once: config, weights, tokenizer and sampling defaults all come from that parse. The
    model owns every weight when this returns (the mapping is not read again)."""
    from pagedllm.model import gguf_loader
    from pagedllm.model.generation_config import gguf_sampling_defaults
    from pagedllm.model.gguf_config import config_from_gguf
    from pagedllm.model.gguf_reader import read_gguf

    f = read_gguf(path)
    try:
        cfg = config_from_gguf(f)
        sampling = gguf_sampling_defaults(f)
        table = registry.spec(cfg.architecture).gguf_names
        dense_bytes = 2 * sum(math.prod(t.shape) for t in f.tensors.values())
        method = (None if quantization == "none" else
                  _quantized_method(quantize_floats=False, dense_bytes=dense_bytes if quantization == "auto" else None))
        tdtype = resolve_dtype(dtype, quantized=method is not None)
        _check_fits_in_memory(f, as_stored=method is not None, dtype=tdtype)
        # the tokenizer before the weights: parsing a large vocabulary's tokenizer.json peaks at several times what
        # it keeps (model/tokenizer.py), and that peak should not sit on top of the weights
        tok = tokenization.load_tokenizer(path, f) if load_tokenizer else None
        weights = gguf_loader.iter_gguf_weights(f, cfg, as_stored=method is not None)
        model = _build(cfg, tdtype, weights, table, attention_backend, method, path)
    finally:
        f.close()
    _fill_eos_from_tokenizer(cfg, tok)
    return LoadedModel(model, cfg, tok, gguf_model_name(path), cfg.eos_token_ids, tdtype, path, sampling)


def _check_fits_in_memory(f, *, as_stored: bool, dtype: torch.dtype) -> None:
    """InvalidModelError, before anything is read, where the weights would not fit in the memory available: one
    line naming both sizes (a load past it would end in swapping or the OOM killer, not an error)."""
    import psutil

    if as_stored:
        need = sum(t.nbytes for t in f.tensors.values())
    else:
        need = sum(math.prod(t.shape) for t in f.tensors.values()) * dtype.itemsize
    available = psutil.virtual_memory().available
    if need > available:
        how = "as stored" if as_stored else f"dequantized to {str(dtype).removeprefix('torch.')}"
        raise InvalidModelError(f"the weights take {need / 2**30:.1f} GiB in memory ({how}), more than the "
                                f"{available / 2**30:.1f} GiB available", path=f.path)


def _fill_eos_from_tokenizer(cfg: ModelConfig, tok: Any) -> None:
    if not cfg.eos_token_ids and tok is not None and tok.eos_token_id is not None:
        cfg.eos_token_ids = [int(tok.eos_token_id)]


