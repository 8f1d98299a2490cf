"""Native (C++/OpenMP) kernels: paged attention, the GEMMs, the fused decoder layer and the sampler.

One extension built from csrc/ on first use (build.py); each kernel family has its own source file. dispatch.py
decides which kernel runs (what this build can run, and the KernelMode of the step).

Batch-invariant mode (on by default): every kernel computes a row the same way whatever else is in the batch, so
a request's tokens do not depend on what it is batched with, how its prompt was chunked or whether its prefix came
from the cache. The model runner runs each forward in the engine's KernelMode (EngineArgs.batch_invariant).
"""

from pagedllm.kernels.dispatch import (
    DEFAULT_MODE,
    KernelMode,
    capabilities,
    current_mode,
    forward_context,
    kernel_mode,
    kernel_op,
    rounds_int8_queries,
    small_gemm_max_rows,
)
from pagedllm.kernels.library import load_ops
from pagedllm.kernels.paged_attention import paged_attention, write_kv_int8
from pagedllm.kernels.variants import build_variant

__all__ = ["DEFAULT_MODE", "KernelMode", "build_variant", "capabilities", "current_mode", "forward_context",
           "kernel_mode", "kernel_op", "load_ops", "paged_attention", "rounds_int8_queries", "small_gemm_max_rows",
           "write_kv_int8"]
