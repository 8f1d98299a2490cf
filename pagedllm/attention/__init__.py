"""Paged attention backends behind one interface, chosen by name.

Every backend has forward(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], k_cache, v_cache, meta, scale, window=None,
sinks=None) -> [T,Hq,D] (window: each query sees its `window` most recent keys, itself included; sinks [Hq]: a
logit per query head that joins the softmax's denominator and adds no value, gpt-oss's attention sinks)
and copy_blocks(kv_caches, pairs). "reference" is the pure-torch oracle; faster backends register themselves
with a priority and "auto" picks the highest-priority one that is available.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata, build_attention_metadata, compute_positions
from pagedllm.attention.reference import ReferenceBackend, copy_blocks

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "AttentionMetadata", "build_attention_metadata", "compute_positions",
           "copy_blocks", "get_backend", "register_backend", "available_backends"]


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor: ...

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    pairs: list[tuple[int, int]]) -> None: ...


# name -> (priority, factory). A factory may raise (e.g. ImportError, build failure): then it is unavailable.
_REGISTRY: dict[str, tuple[int, Callable[[], Any]]] = {"reference": (0, ReferenceBackend)}
# Optional modules that register faster backends when imported (missing ones are skipped).
_OPTIONAL_MODULES = ["pagedllm.attention.cpu"]


def register_backend(name: str, factory: Callable[[], Any], priority: int = 10) -> None:
    _REGISTRY[name] = (priority, factory)


def _load_optional() -> None:
    for mod in _OPTIONAL_MODULES:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            if getattr(e, "name", None) != mod:
                logger.debug("optional attention module %s unavailable: %s", mod, e)


def available_backends() -> list[str]:
    _load_optional()
    return sorted(_REGISTRY, key=lambda n: -_REGISTRY[n][0])


def get_backend(name: str = "auto") -> AttentionBackend:
    """'reference', another registered name, or 'auto' (the highest-priority backend that builds)."""
    _load_optional()
    if name == "auto":
        for cand in available_backends():
            try:
                backend = _REGISTRY[cand][1]()
            except Exception as e:  # a kernel that fails to build must not stop the engine
                logger.warning("attention backend %r unavailable (%s); trying the next one", cand, e)
                continue
            logger.info("attention backend: %s", cand)
            return backend
        raise RuntimeError("no attention backend available")
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(available_backends())}")
    return _REGISTRY[name][1]()
