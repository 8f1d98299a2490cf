"""Hugging Face directory: config.json, safetensors (single or sharded), tokenizer, generation_config."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from pagedllm.model.config import ModelConfig, config_from_hf
from pagedllm.model.errors import InvalidModelError, UnsupportedModelError

logger = logging.getLogger(__name__)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def read_hf_config(model_dir: str) -> tuple[ModelConfig, dict]:
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    raw = _read_json(cfg_path)
    gen_path = os.path.join(model_dir, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else None
    try:
        return config_from_hf(raw, gen), raw
    except InvalidModelError as e:
        raise e.with_path(cfg_path) from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a field of the wrong kind
        raise InvalidModelError(f"unreadable config: {type(e).__name__}: {e}", path=cfg_path) from e


STORED_QUANTIZATION = ("mxfp4",)  # config.json quant_method values whose blocks pagedllm reads (gpt-oss's experts)


def stored_quantization(raw: dict, path: str) -> str | None:
    """The checkpoint's quantization_config.quant_method: None for float weights, "mxfp4" for OpenAI's gpt-oss;
    UnsupportedModelError for any other (GPTQ, AWQ, bitsandbytes, ...)."""
    method = (raw.get("quantization_config") or {}).get("quant_method")
    if method is not None and method not in STORED_QUANTIZATION:
        raise UnsupportedModelError(f"quantization_config.quant_method {method!r} is not supported; supported: "
                                    f"{', '.join(STORED_QUANTIZATION)} (or float weights)", path=path)
    return method


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        files = [os.path.join(model_dir, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"shard(s) listed in {index} are missing: {missing}")
        return files
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (pytorch .bin files are not supported)")
    return [os.path.join(model_dir, f) for f in found]


def iter_hf_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_hf_tokenizer(model_dir: str):
    """The directory's tokenizer (with its chat template), or None with a warning if it has none: token-id
    prompts still work, text prompts will fail with a clear message at the engine."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files (%s): only token-id prompts will work", model_dir,
                       ", ".join(_TOKENIZER_FILES))
        return None
    from pagedllm.model.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)
