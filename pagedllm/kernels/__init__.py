"""Native (C++/OpenMP) kernels: paged attention, the GEMMs, the fused decoder layer and the sampler.

One extension built from csrc/ on first use (build.py); each kernel family has its own source file.

Batch-invariant mode (on by default): every kernel computes a row the same way whatever else is in the batch, so
a request's tokens do not depend on what it is batched with, how its prompt was chunked or whether its prefix came
from the cache. The model runner sets it per step from EngineArgs.batch_invariant.
"""

from collections.abc import Iterator
from contextlib import contextmanager

from pagedllm.kernels.build import build_variant, kernel_op, load_ops
from pagedllm.kernels.paged_attention import paged_attention, rounds_int8_queries, write_kv_int8

__all__ = ["batch_invariant", "build_variant", "kernel_mode", "kernel_op", "load_ops", "paged_attention",
           "rounds_int8_queries", "set_batch_invariant", "small_gemm_max_rows", "write_kv_int8"]

_batch_invariant = True


def set_batch_invariant(enabled: bool) -> None:
    global _batch_invariant
    _batch_invariant = bool(enabled)


def batch_invariant() -> bool:
    return _batch_invariant


@contextmanager
def kernel_mode(invariant: bool) -> Iterator[None]:
    """Batch-invariant (or batch-dependent) kernels inside the block, the previous mode after it."""
    before = batch_invariant()
    set_batch_invariant(invariant)
    try:
        yield
    finally:
        set_batch_invariant(before)


def small_gemm_max_rows() -> int:
    """Up to how many rows a bf16 linear runs on the small GEMM (0 where it is not built); defined in C++."""
    available, max_rows = kernel_op("small_gemm_available"), kernel_op("small_gemm_max_rows")
    return int(max_rows()) if available is not None and available() else 0
