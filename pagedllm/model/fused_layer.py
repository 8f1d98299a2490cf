"""Whether a forward runs the decoder layers as one C++ call (csrc/decoder_layer.cpp: DecoderStack.forward), and
running them: the one place that decides. The parts it reads are declarations: the architecture's (registry: its
layer is the fused one, for these config features), each Linear method's (it keeps a weight the stack can read),
the attention backend's (its kernel is the stack's), and the build's capabilities (kernels/dispatch.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedllm.attention.metadata import AttentionMetadata, per_layer
from pagedllm.kernels import dispatch
from pagedllm.model import registry
from pagedllm.model.config import ModelConfig
from pagedllm.model.kv_cache import KVCache, KVCacheList
from pagedllm.model.linear import Linear
from pagedllm.model.moe import SparseMoE


def can_fuse(cfg: ModelConfig, linears: Iterable[Linear]) -> bool:
    """The model's structure allows the fused layer (fixed at construction): the architecture declares it for the
    features the config uses, and every linear's method keeps a weight the op reads."""
    return (registry.spec(cfg.architecture).runs_fused_layer(cfg.features())
            and all(lin.method.runs_fused_layer for lin in linears))


def init_fused_layers(model) -> None:
    """At the end of a model class's __init__, once its layers exist: `fused_layers`, the switch (on: the layers in
    one C++ call where the kernels allow; tests turn it off), and `_fused_capable`, what can_fuse says of it."""
    model.fused_layers = True
    model._fused_capable = can_fuse(model.config, (m for m in model.modules() if isinstance(m, Linear)))


def fuses_layers(model, h: torch.Tensor, kv_caches: list[KVCache]) -> bool:
    """Whether this forward runs its layers as one DecoderStack call (else the model runs its torch layers):
    - bf16 (weights dense or quantized) where the build has avx512_bf16;
    - fp32 with quantized weights (segments) where the build has AVX-512.
    In batch-invariant mode its GEMMs are the torch layers' invariant ones (dense: gemm_invariant; quantized: the
    quantized GEMM, invariant in every mode), so it is as invariant as they are.
    Always: the model allows it (`model.fused_layers`, can_fuse), the attention backend is the C++ kernel on its
    vector paths, the caches are views of one KV pool of the compute dtype (the stack writes K/V itself, and
    takes the pool whole: kv_cache.allocate_kv_caches), and every mixture of experts has its kernel form."""
    mode = dispatch.current_mode()
    if not (dispatch.kernel_class("DecoderStack") is not None and model.fused_layers and model._fused_capable
            and h.shape[0] > 0 and kv_caches and hasattr(kv_caches, "pool") and kv_caches[0][0].dtype == h.dtype
            and not mode.portable and getattr(model.attn_backend, "runs_fused_layers", False)
            and _experts_have_tables(model)):
        return False
    if h.dtype == torch.bfloat16:
        return dispatch.has(dispatch.AVX512_BF16)
    return h.dtype == torch.float32 and any(lin.method.segmented for lin in model.layers[0].linears())


def _experts_have_tables(model) -> bool:
    """Every mixture of experts keeps its experts in the form csrc/moe.cpp runs (asked once: the tables are built
    at the first forward, after the weights loaded)."""
    found = getattr(model, "_experts_fuse", None)
    if found is None:
        found = model._experts_fuse = all(layer.mlp.table() is not None for layer in model.layers
                                          if isinstance(layer.mlp, SparseMoE))
    return found


def run_fused_layers(model, h: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
                     kv_caches: KVCacheList, meta: AttentionMetadata | list[AttentionMetadata]) -> None:
    """h through every decoder layer and the final norm, in place: one stack call for each run of layers that share
    their attention metadata (all the layers but where KV groups give each its own) and their RoPE (cos, sin)
    (ropes: one pair per layer; Gemma's sliding layers have their own base)."""
    metas = per_layer(meta, len(model.layers))
    stack, invariant = _bound_stack(model), dispatch.current_mode().invariant
    first = 0
    while first < len(metas):
        end = first + 1
        while end < len(metas) and metas[end] is metas[first] and ropes[end] is ropes[first]:
            end += 1
        m, (cos, sin) = metas[first], ropes[first]
        stack.forward(h, cos, sin, kv_caches.pool, kv_caches.pool_rows, m.slot_mapping, m.block_tables,
                      m.seq_lens, m.query_start_loc, first, end - first, invariant)
        first = end


def _bound_stack(model):
    """The model's DecoderStack: every layer's weights bound once, at its first fused forward (the Parameters stay
    the same objects when weights are loaded, only their data changes, and the stack reads them through them)."""
    stack = getattr(model, "_decoder_stack", None)
    if stack is None:
        cfg, attn = model.config, model.layers[0].attn
        inter = cfg.intermediate_size or cfg.moe_intermediate_size  # (the dense layers' width; experts bring theirs)
        stack = dispatch.kernel_class("DecoderStack")(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                      inter, cfg.rms_norm_eps, attn.scale, model.norm.weight,
                                                      model.FUSED_STYLE, cfg.residual_multiplier)
        for layer in model.layers:
            stack.add_layer(*layer.fused_weights())
            if isinstance(layer.mlp, SparseMoE):
                stack.add_experts(*layer.mlp.fused_experts())
        model._decoder_stack = stack
    return stack
