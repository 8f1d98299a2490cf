"""Paged attention backends behind one interface, chosen by name.

Every backend has forward(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], k_cache, v_cache, meta, scale, window=None,
sinks=None) -> [T,Hq,D] (window: each query sees its `window` most recent keys, itself included; sinks [Hq]: a
logit per query head that joins the softmax's denominator and adds no value, gpt-oss's attention sinks)
and copy_blocks(kv_caches, pairs). "reference" is the pure-torch oracle; faster backends register themselves
with a priority per device type they run on, and "auto" picks the highest-priority one that is available for the
device ("cpu": the C++ kernel; "cuda": the Triton kernel or FlexAttention). A negative priority: the backend runs
on that device when named, but "auto" never picks it there (Triton interpreted, FlexAttention on the CPU: for
tests).

The metadata's tensors live on the pool's device; its host lists (query_lens_list, seq_lens_list, max_*) are
there so that a backend never reads a device tensor back in a step.
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
    # True: the model's other layers may run the C++ CPU kernels beside this backend; absent or False: a device
    # backend, beside which every layer runs in torch on the pool's device (dispatch.KernelMode.cpu_kernels)
    cpu_kernels: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor: ...

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    pairs: list[tuple[int, int]]) -> None: ...


# name -> ({device type: priority}, factory). A factory may raise (e.g. ImportError, build failure): then it is
# unavailable.
_REGISTRY: dict[str, tuple[dict[str, int], Callable[[], Any]]] = {
    "reference": ({"cpu": 0, "cuda": 0}, ReferenceBackend)}
# Optional modules that register faster backends when imported (missing ones are skipped): the CPU's, and the
# device backends, imported only when a GPU or one of them is asked for (importing triton costs ~0.4 s)
_CPU_MODULES = ["pagedllm.attention.cpu"]
_DEVICE_MODULES = ["pagedllm.attention.triton_paged", "pagedllm.attention.flex_paged"]


def register_backend(name: str, factory: Callable[[], Any], priority: dict[str, int]) -> None:
    """priority: {device type: priority} for each device the backend runs on (negative: only when named)."""
    _REGISTRY[name] = (dict(priority), factory)


def _load_optional(devices: bool = True) -> None:
    for mod in _CPU_MODULES + (_DEVICE_MODULES if devices else []):
        try:
            importlib.import_module(mod)
        except ImportError as e:
            if getattr(e, "name", None) != mod:
                logger.debug("optional attention module %s unavailable: %s", mod, e)


def _ranked(kind: str) -> list[str]:
    return sorted((n for n in _REGISTRY if kind in _REGISTRY[n][0]), key=lambda n: -_REGISTRY[n][0][kind])


def available_backends(device: str | torch.device = "cpu") -> list[str]:
    """The backends that run on the device's type, the highest priority first (those only named included)."""
    _load_optional()
    return _ranked(torch.device(device).type)


def get_backend(name: str = "auto", device: str | torch.device = "cpu") -> AttentionBackend:
    """'reference', another registered name, or 'auto' (the highest-priority backend that builds for the device's
    type)."""
    kind = torch.device(device).type
    _load_optional(devices=kind != "cpu" or name not in ("auto", *_REGISTRY))
    if name == "auto":
        for cand in _ranked(kind):
            if _REGISTRY[cand][0][kind] < 0:
                continue
            try:
                backend = _REGISTRY[cand][1]()
            except Exception as e:  # a kernel that fails to build must not stop the engine
                logger.warning("attention backend %r unavailable (%s); trying the next one", cand, e)
                continue
            logger.info("attention backend: %s", cand)
            return backend
        raise RuntimeError(f"no attention backend available for {kind}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(_REGISTRY)}")
    if kind not in _REGISTRY[name][0]:
        raise ValueError(f"attention backend {name!r} does not run on {kind}; backends for {kind}: "
                         f"{', '.join(available_backends(device))}")
    return _REGISTRY[name][1]()
