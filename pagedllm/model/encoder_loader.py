"""load_encoder(path, dtype): an encoder (model/bert.py) from a Hugging Face directory (BERT, XLM-R and NomicBERT
tensor names, NomicBERT's hub names and transformers' own) or a GGUF file as llama.cpp's converter writes it
(`bert`, `nomic-bert`; quantized matrices are dequantized: encoders are small and read each weight once a batch)."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.dtypes import resolve_dtype
from pagedllm.model.bert import EncoderModel
from pagedllm.model.encoder_config import EncoderConfig
from pagedllm.model.errors import InvalidModelError

logger = logging.getLogger(__name__)

# checkpoint name (prefixes stripped) -> (our parameter, shard of a fused Linear or None). {i}: the layer.
_HF_NAMES = {
    r"embeddings\.word_embeddings\.weight": ("embed.word", None),
    r"embeddings\.position_embeddings\.weight": ("embed.position", None),
    r"embeddings\.token_type_embeddings\.weight": ("embed.token_type", None),
    r"(?:embeddings\.LayerNorm|emb_ln)\.(weight|bias)": ("embed.norm.{0}", None),
    # BERT / XLM-R
    r"encoder\.layer\.(\d+)\.attention\.self\.query\.(weight|bias)": ("layers.{0}.qkv.{1}", 0),
    r"encoder\.layer\.(\d+)\.attention\.self\.key\.(weight|bias)": ("layers.{0}.qkv.{1}", 1),
    r"encoder\.layer\.(\d+)\.attention\.self\.value\.(weight|bias)": ("layers.{0}.qkv.{1}", 2),
    r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)": ("layers.{0}.o.{1}", None),
    r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|bias)": ("layers.{0}.attn_norm.{1}", None),
    r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)": ("layers.{0}.up.{1}", None),
    r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)": ("layers.{0}.down.{1}", None),
    r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)": ("layers.{0}.out_norm.{1}", None),
    # NomicBERT as the hub stores it, and as transformers' NomicBertModel names it
    r"encoder\.layers\.(\d+)\.attn\.Wqkv\.(weight)": ("layers.{0}.qkv.{1}", None),
    r"(?:encoder\.)?layers\.(\d+)\.(?:attn\.out_proj|self_attn\.o_proj)\.(weight)": ("layers.{0}.o.{1}", None),
    r"layers\.(\d+)\.self_attn\.q_proj\.(weight)": ("layers.{0}.qkv.{1}", 0),
    r"layers\.(\d+)\.self_attn\.k_proj\.(weight)": ("layers.{0}.qkv.{1}", 1),
    r"layers\.(\d+)\.self_attn\.v_proj\.(weight)": ("layers.{0}.qkv.{1}", 2),
    r"(?:encoder\.)?layers\.(\d+)\.mlp\.(?:fc12|gate_proj)\.(weight)": ("layers.{0}.up.{1}", 0),
    r"(?:encoder\.)?layers\.(\d+)\.mlp\.(?:fc11|up_proj)\.(weight)": ("layers.{0}.up.{1}", 1),
    r"(?:encoder\.)?layers\.(\d+)\.mlp\.(?:fc2|down_proj)\.(weight)": ("layers.{0}.down.{1}", None),
    r"(?:encoder\.)?layers\.(\d+)\.(?:norm1|post_attention_layernorm)\.(weight|bias)": ("layers.{0}.attn_norm.{1}",
                                                                                        None),
    r"(?:encoder\.)?layers\.(\d+)\.(?:norm2|post_mlp_layernorm)\.(weight|bias)": ("layers.{0}.out_norm.{1}", None),
    # cross-encoder heads: BERT's pooler + classifier, RoBERTa's classifier.dense + out_proj
    r"(?:pooler\.dense|classifier\.dense)\.(weight|bias)": ("classifier.dense.{0}", None),
    r"classifier\.(?:out_proj\.)?(weight|bias)": ("classifier.out.{0}", None),
}
_GGUF_NAMES = {
    r"token_embd\.weight": ("embed.word", None),
    r"position_embd\.weight": ("embed.position", None),
    r"token_types\.weight": ("embed.token_type", None),
    r"token_embd_norm\.(weight|bias)": ("embed.norm.{0}", None),
    r"blk\.(\d+)\.attn_q\.(weight|bias)": ("layers.{0}.qkv.{1}", 0),
    r"blk\.(\d+)\.attn_k\.(weight|bias)": ("layers.{0}.qkv.{1}", 1),
    r"blk\.(\d+)\.attn_v\.(weight|bias)": ("layers.{0}.qkv.{1}", 2),
    r"blk\.(\d+)\.attn_qkv\.(weight|bias)": ("layers.{0}.qkv.{1}", None),
    r"blk\.(\d+)\.attn_output\.(weight|bias)": ("layers.{0}.o.{1}", None),
    r"blk\.(\d+)\.attn_output_norm\.(weight|bias)": ("layers.{0}.attn_norm.{1}", None),
    r"blk\.(\d+)\.ffn_gate\.(weight)": ("layers.{0}.up.{1}", 0),
    r"blk\.(\d+)\.ffn_up\.(weight|bias)": ("layers.{0}.up.{1}", "up"),
    r"blk\.(\d+)\.ffn_down\.(weight|bias)": ("layers.{0}.down.{1}", None),
    r"blk\.(\d+)\.layer_output_norm\.(weight|bias)": ("layers.{0}.out_norm.{1}", None),
    r"cls\.(weight|bias)": ("classifier.dense.{0}", None),
    r"cls\.output\.(weight|bias)": ("classifier.out.{0}", None),
}
# heads a checkpoint may carry that neither an embedding nor a score reads (masked-LM, next-sentence)
_UNUSED = re.compile(r"(cls\.predictions|cls\.seq_relationship|lm_head|embeddings\.position_ids)")
_PREFIXES = ("bert.", "roberta.", "model.")


@dataclass
class LoadedEncoder:
    model: EncoderModel
    config: EncoderConfig
    tokenizer: Any
    name: str
    dtype: torch.dtype
    path: str


def encoder_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """"auto": bf16 only where the CPU computes in it (avx512_bf16 / AMX), else fp32. An encoder step multiplies
    thousands of rows, compute-bound, where emulated bf16 GEMMs run ~5x slower than fp32 (Zen 3, bench embed); the
    decoders' reason for bf16 without it (half the weight bytes each decode step reads) does not apply."""
    from pagedllm.kernels.library import native_bf16

    if dtype == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    return resolve_dtype(dtype)


def load_encoder(path: str, dtype: str | torch.dtype = "auto") -> LoadedEncoder:
    t0 = time.perf_counter()
    tdtype = encoder_dtype(dtype)
    try:
        loaded = _load_gguf(path, tdtype) if os.path.isfile(path) else _load_hf(path, tdtype)
    except InvalidModelError as e:
        raise e.with_path(path) from None
    logger.info("loaded encoder %s (%s%s, %s) in %.2f s", loaded.name, loaded.config.architecture,
                ", cross-encoder" if loaded.config.is_cross_encoder else "", str(tdtype).removeprefix("torch."),
                time.perf_counter() - t0)
    return loaded


def _load_hf(path: str, dtype: torch.dtype) -> LoadedEncoder:
    from pagedllm.model import hf_loader
    from pagedllm.model.encoder_config import config_from_hf

    with open(os.path.join(path, "config.json")) as f:
        cfg = config_from_hf(json.load(f))
    model = EncoderModel(cfg, dtype)
    _put_weights(model, hf_loader.iter_hf_weights(path), _HF_NAMES, strip=_PREFIXES)
    tokenizer = hf_loader.load_hf_tokenizer(path)
    return LoadedEncoder(model, cfg, tokenizer, os.path.basename(os.path.normpath(path)), dtype, path)


def _load_gguf(path: str, dtype: torch.dtype) -> LoadedEncoder:
    from pagedllm.model.encoder_config import config_from_gguf
    from pagedllm.model.gguf_loader import dequantize
    from pagedllm.model.gguf_reader import read_gguf
    from pagedllm.model.loader import gguf_model_name
    from pagedllm.model.wordpiece import load_gguf_wordpiece

    f = read_gguf(path)
    try:
        cfg = config_from_gguf(f)
        tokenizer = load_gguf_wordpiece(path, f)
        model = EncoderModel(cfg, dtype)
        _put_weights(model, ((name, dequantize(f, info)) for name, info in f.tensors.items()), _GGUF_NAMES)
    finally:
        f.close()
    return LoadedEncoder(model, cfg, tokenizer, gguf_model_name(path), dtype, path)


def _put_weights(model: EncoderModel, weights: Iterable[tuple[str, torch.Tensor]], table: dict[str, tuple],
                 strip: tuple[str, ...] = ()) -> None:
    """Every checkpoint tensor into its parameter (a Linear's shard where the table names one); InvalidModelError
    for a tensor of the wrong shape, one the model has no place for, or a parameter nothing filled."""
    compiled = [(re.compile(pattern), target) for pattern, target in table.items()]
    params = dict(model.named_parameters())
    filled: set[str] = set()
    for name, tensor in weights:
        short = name
        for prefix in strip:
            short = short.removeprefix(prefix)
        target = _target(compiled, short)
        if target is None:
            if _UNUSED.match(short):
                continue
            raise InvalidModelError("a tensor this encoder has no place for", field=f"tensor {name!r}")
        param, shard = target
        if param.startswith("classifier.dense") and model.classifier is None:
            continue  # an embedder's BERT pooler
        if param not in params:
            raise InvalidModelError(f"no parameter {param} in this model", field=f"tensor {name!r}")
        _load(model, param, shard, tensor, name)
        filled.add(param)
    missing = sorted(set(params) - filled)
    if missing:
        raise InvalidModelError(f"tensors missing for {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")


def _target(compiled: list, name: str) -> tuple[str, int | str | None] | None:
    for pattern, (param, shard) in compiled:
        m = pattern.fullmatch(name)
        if m:
            return param.format(*m.groups()), shard
    return None


def _load(model: EncoderModel, param: str, shard: int | str | None, tensor: torch.Tensor, name: str) -> None:
    owner_name, _, leaf = param.rpartition(".")
    owner = model.get_submodule(owner_name)
    if shard == "up":  # GGUF ffn_up: the whole MLP input of BERT, the up half of a gated one (NomicBERT)
        shard = 1 if model.config.gated else None
    try:
        if hasattr(owner, "load_weight"):  # a Linear
            owner.load_weight(leaf, tensor, shard, name)
            return
        p = getattr(owner, leaf)
        if tuple(tensor.shape) != tuple(p.shape):
            raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match the config "
                             f"({tuple(p.shape)})")
        p.data = tensor.to(p.dtype).contiguous()
    except ValueError as e:
        raise InvalidModelError(str(e)) from e
