"""The "cpu" attention backend: the C++ paged-attention kernel (pagedllm/kernels/csrc/paged_attention.cpp).

The kernel reads K/V blocks in place through the block tables (no gathered copy), with an online softmax across
chunks of keys, all query heads of a KV head together (GQA), fp32, bf16 or int8 KV, parallel over (request, KV head,
tile) with OpenMP and long contexts split across threads and merged. An int8 pool (attention/kv_quant.py) is
written by the C++ quantize-and-scatter op and dequantized inside the kernel. Constructing the backend builds (or loads)
the kernels; if the build fails, get_backend("auto") logs a warning and falls back to the reference backend.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedllm.attention import register_backend
from pagedllm.attention.kv_quant import is_int8
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import copy_blocks, write_kv
from pagedllm.kernels import current_mode, load_ops, paged_attention, write_kv_int8


class CpuAttentionBackend:
    """The C++ kernel behind the backend interface."""

    name = "cpu"
    cpu_kernels = True  # the model's other C++ kernels run beside it (dispatch.KernelMode.cpu_kernels)
    copy_blocks = staticmethod(copy_blocks)

    def __init__(self, portable: bool = False) -> None:
        load_ops()
        self.portable = portable  # the portable path whatever the forward's mode (the vector paths' oracle)
        # the model may run whole decoder layers in C++ (decoder_layer.cpp), which call this kernel's fast path
        self.runs_fused_layers = not portable

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        (write_kv_int8 if is_int8(k_cache) else write_kv)(k, v, k_cache, v_cache, meta.slot_mapping)
        mode = current_mode()
        if self.portable:
            mode = dataclasses.replace(mode, portable=True)
        return paged_attention(q, k_cache, v_cache, meta, scale, mode=mode, window=window, sinks=sinks)


register_backend("cpu", CpuAttentionBackend, priority={"cpu": 20})
