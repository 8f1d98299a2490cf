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


def generation_defaults(model_path: str, mode: str = "auto", gguf_defaults: dict[str, Any] | None = None
                        ) -> dict[str, Any]:
    """SamplingParams keyword defaults the model recommends ({} when it has none, or mode == "vllm").
    gguf_defaults: what the loader already read from the model's GGUF file (gguf_sampling_defaults)."""
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
        if gguf_defaults is None:
            from pagedllm.model.gguf_reader import read_gguf

            gguf_defaults = gguf_sampling_defaults(read_gguf(source))
        found = gguf_defaults
    else:
        return {}
    if found:
        logger.info("default sampling parameters from the model (--generation-config vllm to ignore): %s", found)
    return found


def gguf_sampling_defaults(f: Any) -> dict[str, Any]:
    """The `general.sampling.*` values of a parsed GGUF file (model/gguf_reader.GGUFFile), each a finite
    non-negative number (InvalidModelError naming the key otherwise)."""
    import math

    found = {}
    for key, field in _GGUF_KEYS.items():
        if key not in f.metadata:
            continue
        value = f.metadata[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise f.field_error(key, f"{value!r} is not a finite non-negative number")
        found[field] = int(value) if field == "top_k" else float(value)
    return found
