"""Whether a forward runs each decoder layer as one C++ call (csrc/decoder_layer.cpp), and which op: the one
place that decides. The parts it reads are declarations: the architecture's (registry: its layer is the fused
one, for these config features), each Linear method's (it keeps a weight the op can read), the attention
backend's (its kernel is the op's), and the build's capabilities (kernels/dispatch.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from pagedllm.kernels import dispatch
from pagedllm.model import registry
from pagedllm.model.config import ModelConfig
from pagedllm.model.kv_cache import KVCache
from pagedllm.model.linear import Linear


def can_fuse(cfg: ModelConfig, linears: Iterable[Linear]) -> bool:
    """The model's structure allows the fused layer (fixed at construction): the architecture declares it for the
    features the config uses, and every linear's method keeps a weight the op reads."""
    return (registry.spec(cfg.architecture).runs_fused_layer(cfg.features())
            and all(lin.method.runs_fused_layer for lin in linears))


def op_name(linears: Iterable[Linear]) -> str:
    """decoder_layer_quant where a linear keeps weight segments (GGUF blocks, which the op takes as (tensors,
    types) pairs), else decoder_layer_bf16 (dense weights of the model's dtype)."""
    return "decoder_layer_quant" if any(lin.method.segmented for lin in linears) else "decoder_layer_bf16"


def fused_layer_op(model, h: torch.Tensor, kv_caches: list[KVCache]) -> Callable | None:
    """The fused decoder-layer op for this forward, or None (the model runs its torch layers):
    - bf16 (weights dense or quantized) where the build has avx512_bf16, but never in batch-invariant mode: its
      dense GEMMs switch kernels with the row count;
    - fp32 with quantized weights where the build has AVX-512: batch-invariant as its torch layers are.
    Always: the model allows it (`model.fused_layers`, can_fuse), the attention backend is the C++ kernel on its
    vector paths, and the KV pool holds the compute dtype (the op writes K/V itself)."""
    mode = dispatch.current_mode()
    if not (model.fused_layers and model._fused_capable and h.shape[0] > 0 and kv_caches and not mode.portable
            and kv_caches[0][0].dtype == h.dtype and getattr(model.attn_backend, "runs_fused_layers", False)):
        return None
    name = op_name(model.layers[0].linears())
    if h.dtype == torch.bfloat16:
        return None if mode.invariant or not dispatch.has(dispatch.AVX512_BF16) else dispatch.kernel_op(name)
    if h.dtype == torch.float32 and name == "decoder_layer_quant":
        return dispatch.kernel_op(name)
    return None
