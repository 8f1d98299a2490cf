"""Default sampling parameters from the model, as vLLM's `--generation-config auto`: a HF checkpoint's
generation_config.json, or a GGUF file's `general.sampling.*` keys. `vllm` ignores the model (plain defaults);
any other value names a directory holding a generation_config.json."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


def generation_defaults(model_path: str, mode: str = "auto") -> dict[str, Any]:
    """SamplingParams keyword defaults the model recommends ({} when it has none, or mode == "vllm")."""
    if mode == "vllm":
        return {}
    source = model_path if mode == "auto" else mode
    if os.path.isdir(source):
        file = os.path.join(source, "generation_config.json")
        if not os.path.isfile(file):
            if mode != "auto":
                raise ValueError(f"generation_config: no generation_config.json in {source}")
            return {}
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
        if cfg.get("do_sample") is False:  # transformers' greedy flag: sampling values are then ignored
            cfg = {"temperature": 0.0, **{k: v for k, v in cfg.items() if k == "max_new_tokens"}}
        found = {field: cfg[key] for key, field in _HF_KEYS.items() if cfg.get(key) is not None}
    elif os.path.isfile(source):
        found = _gguf_defaults(source)
    else:
        return {}
    if found:
        logger.info("default sampling parameters from the model (--generation-config vllm to ignore): %s", found)
    return found


def _gguf_defaults(path: str) -> dict[str, Any]:
    # our own reader: gguf's GGUFReader parses every field, seconds on a tokenizer's vocabulary
    from pagedllm.model.gguf_loader import read_gguf

    metadata = read_gguf(path).metadata
    return {field: int(metadata[key]) if field == "top_k" else float(metadata[key])
            for key, field in _GGUF_KEYS.items() if key in metadata}
