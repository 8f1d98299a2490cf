"""How a checkpoint pools: sentence-transformers' modules, else the GGUF's pooling_type, else last token +
L2 normalisation (vLLM's default for decoder embedders such as Qwen3-Embedding)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# llama.cpp's enum llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last, 4 rank
_GGUF_POOLING = {1: "MEAN", 2: "CLS", 3: "LAST"}
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: str = "LAST"
    normalize: bool = True
    # a decoder reranker (Qwen3-Reranker): the ("no", "yes") token ids whose last-token logits make its score
    score_tokens: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")

    @property
    def needs_every_token(self) -> bool:
        """Mean and CLS read prompt rows the prefix cache would skip; the last token is always computed."""
        return self.pooling_type != "LAST"


def resolve_pooling_config(model_path: str, default: PoolingConfig | None = None) -> PoolingConfig:
    """The checkpoint's pooling: a directory's modules.json, else a .gguf file's `{arch}.pooling_type`, else
    `default` (None: the decoders' last token, normalised; encoders pass CLS)."""
    default = default or PoolingConfig()
    if os.path.isdir(model_path):
        found = _sentence_transformers(model_path, default)
        if found is not None:
            return found
    elif model_path.endswith(".gguf"):
        found = _gguf(model_path)
        if found is not None:
            return found
    return default


def _sentence_transformers(path: str, default: PoolingConfig) -> PoolingConfig | None:
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file) as f:
        modules = json.load(f)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    normalize = "Normalize" in kinds
    if "Pooling" not in kinds:
        return PoolingConfig(default.pooling_type, normalize)
    with open(os.path.join(path, kinds["Pooling"], "config.json")) as f:
        pooling = json.load(f)
    modes = [kind for key, kind in _ST_MODES.items() if pooling.get(key)]
    if len(modes) != 1:
        raise ValueError(f"{path}: pooling config asks for {modes or 'no mode'}; supported: exactly one of "
                         f"{sorted(_ST_MODES)}")
    return PoolingConfig(modes[0], normalize)


def _gguf(path: str) -> PoolingConfig | None:
    from pagedllm.model.gguf_reader import read_gguf

    gguf = read_gguf(path)
    try:
        value = gguf.metadata.get(f"{gguf.architecture}.pooling_type")
    finally:
        gguf.close()
    if value is None or value == 0:
        return None  # none: a decoder's default below
    if value not in _GGUF_POOLING:
        raise ValueError(f"{path}: pooling_type {value} (rank) is not an embedding pooling")
    return PoolingConfig(_GGUF_POOLING[value], True)


def pooling_config_for(runner: str, hf_overrides: dict | None, model_path: str, tokenizer) -> PoolingConfig | None:
    """The engine's pooling: None for the generate runner; the checkpoint's (resolve_pooling_config); or, where
    hf_overrides names two tokens (classifier_from_token, as vLLM's), a reranker's last token scored by their
    logits (Qwen3-Reranker)."""
    if runner != "pooling":
        return None
    names = (hf_overrides or {}).get("classifier_from_token")
    if names is None:
        return resolve_pooling_config(model_path)
    if not isinstance(names, list | tuple) or len(names) != 2 or not all(isinstance(n, str) for n in names):
        raise ValueError(f"hf_overrides.classifier_from_token must name two tokens (no, yes), got {names!r}")
    ids = []
    for name in names:
        found = tokenizer.convert_tokens_to_ids(name)
        encoded = tokenizer.encode(name, add_special_tokens=False)
        if found is None and len(encoded) == 1:
            found = encoded[0]
        if found is None:
            raise ValueError(f"hf_overrides.classifier_from_token: {name!r} is not one token of the vocabulary")
        ids.append(found)
    return PoolingConfig("LAST", normalize=False, score_tokens=(ids[0], ids[1]))
