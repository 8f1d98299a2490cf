"""Which kernel runs: the one place that asks the extension what it can do, and the mode a step's kernels run in.

- `capabilities()`: what this build of the extension can run (csrc/capabilities.cpp: its instruction sets and
  the sizes they cover), asked once; empty where the extension could not be built.
- `kernel_op(name)` / `kernel_class(name)`: the extension's op or TorchScript class, or None where this build lacks
  what it needs (`OP_NEEDS`) or has no extension at all; the caller keeps its torch path then. No op is ever called
  on a build that cannot run it.
- `KernelMode`: how a step's kernels may compute (batch-invariant arithmetic; the portable attention path). The
  model runner sets it for each forward (`forward_context`); kernels read it with `current_mode()`. Code that
  calls kernels outside a forward (tests, benches) gets `DEFAULT_MODE` or sets one with `kernel_mode(...)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from pagedllm.kernels.library import load_ops

# Capabilities (keys of capabilities()): instruction sets the build was compiled for (1 or 0) and sizes.
AVX512 = "avx512"            # the fp32 vector paths
FUSED_LAYER = "fused_layer"  # the fused fp32 decoder layer (AVX-512, or AVX2 + FMA)
AVX512_BF16 = "avx512_bf16"  # the bf16 small GEMM, the fused bf16 layer, the bf16 attention paths
VNNI = "vnni"                # int8 dot products: the quantized GEMMs' fast paths, int8-KV attention on integers
INT8_GEMM = "int8_gemm"      # the packed quantized GEMM in vector code: VNNI, or AVX2's vpmaddubsw without it
AMX = "amx"                  # the packed GEMM's AMX tiles: this CPU and OS allow them, not only the build

# Ops and classes that exist in every build but run only where the build has a capability (the others run
# everywhere: each has a portable form).
OP_NEEDS: dict[str, str] = {
    "small_gemm_bf16": AVX512_BF16,
    "DecoderStack": FUSED_LAYER,  # its bf16 form needs AVX512_BF16 too: fused_layer.fuses_layers checks
}


@dataclass(frozen=True)
class KernelMode:
    """How the kernels of one forward may compute."""

    invariant: bool = True  # a row's result never depends on the rest of the batch (the engine's default)
    portable: bool = False  # the plain C++ attention path, not the vector ones (their oracle)
    # False: no C++ op runs (kernel_op/kernel_class answer None), every layer takes its torch path: a model on a
    # GPU, or on the CPU with a device attention backend (FlexAttention, Triton), which is how tests run that path
    cpu_kernels: bool = True


DEFAULT_MODE = KernelMode()
_mode: ContextVar[KernelMode] = ContextVar("pagedllm_kernel_mode", default=DEFAULT_MODE)


def current_mode() -> KernelMode:
    """The mode of the forward running on this thread (DEFAULT_MODE outside one)."""
    return _mode.get()


@contextmanager
def forward_context(mode: KernelMode) -> Iterator[KernelMode]:
    """Run the block's kernels in `mode`; the previous mode after it."""
    token = _mode.set(mode)
    try:
        yield mode
    finally:
        _mode.reset(token)


def kernel_mode(**fields: bool) -> Any:
    """forward_context with the current mode's fields replaced: `with kernel_mode(invariant=False): ...`."""
    return forward_context(dataclasses.replace(current_mode(), **fields))


@cache
def capabilities() -> dict[str, int]:
    """What this build of the extension runs: {capability: 1/0, "small_gemm_max_rows": n,
    "vector_head_dims": mask}; {} where the extension cannot be built (every caller keeps a torch path)."""
    try:
        return dict(load_ops().capabilities())
    except Exception:
        return {}


def has(capability: str) -> bool:
    return bool(capabilities().get(capability, 0))


def _runs(name: str) -> bool:
    """The extension is built and has what op or class `name` needs (OP_NEEDS)."""
    needs = OP_NEEDS.get(name)
    return bool(capabilities()) and (needs is None or has(needs))


def kernel_op(name: str) -> Any:
    """The extension's op `name`, or None where the extension is not built, lacks what the op needs, or the
    forward's mode runs no C++ kernel (KernelMode.cpu_kernels)."""
    return _op(name) if _mode.get().cpu_kernels else None


@contextmanager
def matrix_engine(on: bool) -> Iterator[None]:
    """Whether the packed quantized GEMM may use the CPU's matrix engine (AMX) inside the block, for benches and
    tests that compare it with the VNNI path (the same bits: csrc/quant_packed.cpp). Process-wide, not per thread."""
    was = bool(load_ops().set_matrix_engine(on))
    try:
        yield
    finally:
        load_ops().set_matrix_engine(was)


def kernel_class(name: str) -> Any:
    """The extension's TorchScript class `name` (torch.classes.pagedllm_cpu), or None like kernel_op."""
    return _class(name) if _mode.get().cpu_kernels else None


@cache
def _op(name: str) -> Any:
    return getattr(load_ops(), name) if _runs(name) else None


@cache
def _class(name: str) -> Any:
    if not _runs(name):
        return None
    load_ops()
    return getattr(torch.classes.pagedllm_cpu, name)


def small_gemm_max_rows() -> int:
    """Up to how many rows a bf16 linear runs on the small GEMM (0 where the build lacks it); the fused layer
    applies the same limit in C++."""
    return int(capabilities().get("small_gemm_max_rows", 0))


def vector_head_dim(head_dim: int) -> bool:
    """Whether attention over heads of this size has vector paths in this build (else the portable path)."""
    return head_dim > 0 and head_dim & (head_dim - 1) == 0 and bool(capabilities().get("vector_head_dims", 0) & head_dim)


def rounds_int8_queries(head_dim: int, portable: bool = False) -> bool:
    """Whether paged_attention over an int8 KV cache runs on integers for this head size (VNNI q . k and p . V:
    q rounded to int8, see attention/kv_quant.round_queries, and each chunk's probabilities to 15 bits) rather
    than dequantizing K and V. Tests pick their oracle and tolerance by it."""
    return not portable and has(VNNI) and vector_head_dim(head_dim)
