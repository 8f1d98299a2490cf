"""The model registry: architecture name -> model class, checkpoint names and declared capabilities.

Pure data (no torch): config parsing looks architectures up here before any model code is imported. Adding an
architecture is one `ArchSpec` entry below plus, if its layer differs, a model class (docs/INTERFACES.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pagedllm.model import weight_names
from pagedllm.model.errors import UnsupportedModelError  # noqa: F401  (raised here; its historical home)

# Features a checkpoint may use (ModelConfig.features() lists the ones it does use).
QKV_BIAS, O_BIAS, QK_NORM = "qkv_bias", "o_bias", "qk_norm"
SLIDING_WINDOW, TIED_EMBEDDINGS, ROPE_SCALING = "sliding_window", "tied_embeddings", "rope_scaling"
MOE, QK_NORM_WHOLE = "moe", "qk_norm_whole"  # experts in the MLP; q/k norm over the whole projection (OLMoE)
MULTIPLIERS = "multipliers"  # Granite's embedding, residual, attention and logit multipliers
PARTIAL_ROTARY, NOPE = "partial_rotary", "nope_layers"  # RoPE on part of each head (Phi); NoPE layers (SmolLM3)
# gpt-oss: a sink logit per query head in attention; biases on the router and the experts; the experts' SwiGLU
# clamped
ATTENTION_SINKS, MOE_BIAS, CLAMPED_SWIGLU = "attention_sinks", "moe_bias", "clamped_swiglu"

# What decoder_layer.cpp computes: a pre-norm layer (Llama's or Gemma 3's) with these optional parts. A model runs
# its layers fused only when its spec says its layer is one of those and its config uses nothing outside this set.
# (Partial rotary and NoPE layers are in the rotary tables and the Q/K row order, which the stack takes as given;
# of Granite's multipliers the stack takes the residual one and the attention scale, the model the other two.)
FUSED_LAYER_FEATURES = frozenset({QKV_BIAS, O_BIAS, QK_NORM, TIED_EMBEDDINGS, ROPE_SCALING, SLIDING_WINDOW,
                                  PARTIAL_ROTARY, NOPE, MULTIPLIERS, MOE, ATTENTION_SINKS, MOE_BIAS, CLAMPED_SWIGLU})


@dataclass(frozen=True)
class ArchSpec:
    name: str  # our family tag, ModelConfig.architecture
    model_class: str  # "module:Class", imported on first use
    hf_architectures: tuple[str, ...]  # config.json "architectures" entries
    gguf_architectures: tuple[str, ...]  # GGUF general.architecture values
    hf_names: dict[str, weight_names.Target]  # safetensors name -> our parameter
    gguf_names: dict[str, weight_names.Target]  # GGUF tensor name -> our parameter
    supports: frozenset[str]  # features the model class implements
    fused_layer: bool = False  # its decoder layer is one of decoder_layer.cpp's (its model class's FUSED_STYLE)
    always_qkv_bias: bool = False  # q/k/v biases whatever config.json says (Qwen2)
    always_qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    window_switch: str | None = None  # config.json key that turns sliding_window on (Qwen: use_sliding_window)
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaved the Q/K rope pairs
    gguf_norm_shift: float = 0.0  # llama.cpp's converter stored norm weights plus this (Gemma: 1 + w)
    sliding_window_pattern: int | None = None  # every n-th layer global, where a checkpoint does not list them
    gguf_rope_local_theta: float | None = None  # RoPE base of sliding layers (GGUF files do not store it)
    moe_renormalize: bool | None = None  # the top-k weights renormalised whatever config.json says (Mixtral)
    gguf_moe_renormalize: bool = False  # what llama.cpp's graph does for the architecture (a file may say)
    qk_norm_whole: bool = False  # the q/k norm spans all heads' projection (OLMoE), not one head
    nope_interval: int | None = None  # every n-th layer without RoPE, where a checkpoint does not list them (SmolLM3)
    attention_sinks: bool = False  # a learned sink logit per query head (gpt-oss)
    moe_bias: bool = False  # biases on the router and every expert's projections (gpt-oss)
    swiglu_clamp: tuple[float, float] | None = None  # the experts' SwiGLU (limit, alpha) where a file omits them
    hf_adapter: str | None = None  # "module:function" rewriting the safetensors tensors into hf_names' form

    def adapt_hf_weights(self, weights: Iterable[tuple[str, Any]], as_stored: bool) -> Iterable[tuple[str, Any]]:
        """The checkpoint's tensors as hf_names reads them (as_stored: blocks stay blocks)."""
        if self.hf_adapter is None:
            return weights
        module, fn = self.hf_adapter.split(":")
        return getattr(importlib.import_module(module), fn)(weights, as_stored)

    def model_cls(self) -> type:
        module, cls = self.model_class.split(":")
        return getattr(importlib.import_module(module), cls)

    def check_features(self, used: set[str]) -> None:
        """UnsupportedModelError naming the features the checkpoint uses that this architecture lacks."""
        missing = sorted(used - self.supports)
        if missing:
            raise UnsupportedModelError(f"{self.name} models with {', '.join(missing)} are not supported")

    def runs_fused_layer(self, used: set[str]) -> bool:
        return self.fused_layer and used <= FUSED_LAYER_FEATURES


_LLAMA_HF, _LLAMA_GGUF = weight_names.by_format(weight_names.LLAMA)
_LLAMA_FAMILY = dict(model_class="pagedllm.model.llama:LlamaForCausalLM", hf_names=_LLAMA_HF,
                     gguf_names=_LLAMA_GGUF, fused_layer=True,
                     supports=frozenset({QKV_BIAS, O_BIAS, QK_NORM, TIED_EMBEDDINGS, ROPE_SCALING, SLIDING_WINDOW}))
_GEMMA3_HF, _GEMMA3_GGUF = weight_names.by_format(weight_names.GEMMA3)
_PHI3_HF, _PHI3_GGUF = weight_names.by_format(weight_names.PHI3)
_MOE_HF, _MOE_GGUF = weight_names.by_format(weight_names.LLAMA_MOE)
_MIXTRAL_HF, _ = weight_names.by_format(weight_names.MIXTRAL)
_GPT_OSS_HF, _GPT_OSS_GGUF = weight_names.by_format(weight_names.GPT_OSS)
# the llama family's layer with its MLP a mixture of experts (fused where every expert table has a kernel form:
# fused_layer.fuses_layers)
_MOE_FAMILY = dict(model_class="pagedllm.model.llama:LlamaForCausalLM", gguf_names=_MOE_GGUF, fused_layer=True,
                   supports=_LLAMA_FAMILY["supports"] | {MOE})

ARCHITECTURES: dict[str, ArchSpec] = {spec.name: spec for spec in (
    # GGUF "llama" also holds Mixtral (llama.cpp's converter writes it so, with expert tensors)
    ArchSpec("llama", hf_architectures=("LlamaForCausalLM",), gguf_architectures=("llama",),
             gguf_permuted_qk=True, gguf_moe_renormalize=True,
             **{**_LLAMA_FAMILY, "gguf_names": _MOE_GGUF, "supports": _MOE_FAMILY["supports"]}),
    ArchSpec("mistral", hf_architectures=("MistralForCausalLM",), gguf_architectures=("mistral",),
             gguf_permuted_qk=True, **_LLAMA_FAMILY),
    ArchSpec("qwen2", hf_architectures=("Qwen2ForCausalLM",), gguf_architectures=("qwen2",),
             always_qkv_bias=True, window_switch="use_sliding_window", **_LLAMA_FAMILY),
    ArchSpec("qwen3", hf_architectures=("Qwen3ForCausalLM",), gguf_architectures=("qwen3",),
             always_qk_norm=True, window_switch="use_sliding_window", **_LLAMA_FAMILY),
    ArchSpec("gemma3", model_class="pagedllm.model.gemma3:Gemma3ForCausalLM", hf_architectures=("Gemma3ForCausalLM",),
             gguf_architectures=("gemma3",), hf_names=_GEMMA3_HF, gguf_names=_GEMMA3_GGUF, fused_layer=True,
             supports=frozenset({QK_NORM, TIED_EMBEDDINGS, ROPE_SCALING, SLIDING_WINDOW}), always_qk_norm=True,
             gguf_norm_shift=1.0, sliding_window_pattern=6, gguf_rope_local_theta=10000.0),
    ArchSpec("granite", hf_architectures=("GraniteForCausalLM",), gguf_architectures=("granite",),
             gguf_permuted_qk=True, **{**_LLAMA_FAMILY, "supports": _LLAMA_FAMILY["supports"] | {MULTIPLIERS}}),
    ArchSpec("phi3", hf_architectures=("Phi3ForCausalLM",), gguf_architectures=("phi3",),
             **{**_LLAMA_FAMILY, "hf_names": _PHI3_HF, "gguf_names": _PHI3_GGUF,
                "supports": _LLAMA_FAMILY["supports"] | {PARTIAL_ROTARY}}),
    ArchSpec("smollm3", hf_architectures=("SmolLM3ForCausalLM",), gguf_architectures=("smollm3",),
             gguf_permuted_qk=True, window_switch="use_sliding_window", nope_interval=4,
             **{**_LLAMA_FAMILY, "supports": _LLAMA_FAMILY["supports"] | {NOPE}}),
    ArchSpec("qwen3moe", hf_architectures=("Qwen3MoeForCausalLM",), gguf_architectures=("qwen3moe",),
             hf_names=_MOE_HF, always_qk_norm=True, window_switch="use_sliding_window", gguf_moe_renormalize=True,
             **_MOE_FAMILY),
    ArchSpec("mixtral", hf_architectures=("MixtralForCausalLM",), gguf_architectures=(), hf_names=_MIXTRAL_HF,
             moe_renormalize=True, **_MOE_FAMILY),
    ArchSpec("gpt_oss", hf_architectures=("GptOssForCausalLM",), gguf_architectures=("gpt-oss",),
             hf_names=_GPT_OSS_HF, moe_renormalize=True, gguf_moe_renormalize=True, sliding_window_pattern=2,
             attention_sinks=True, moe_bias=True, swiglu_clamp=(7.0, 1.702),
             hf_adapter="pagedllm.model.gpt_oss:split_hf_experts",
             **{**_MOE_FAMILY, "gguf_names": _GPT_OSS_GGUF,
                "supports": _MOE_FAMILY["supports"] | {ATTENTION_SINKS, MOE_BIAS, CLAMPED_SWIGLU}}),
    ArchSpec("olmoe", hf_architectures=("OlmoeForCausalLM",), gguf_architectures=("olmoe",), hf_names=_MOE_HF,
             always_qk_norm=True, qk_norm_whole=True,
             **{**_MOE_FAMILY, "supports": _MOE_FAMILY["supports"] | {QK_NORM_WHOLE}}),
)}


def spec(name: str) -> ArchSpec:
    return ARCHITECTURES[name]


def spec_for_hf(architectures: list[str], model_type: str | None) -> ArchSpec:
    for spec_ in ARCHITECTURES.values():
        if any(a in spec_.hf_architectures for a in architectures):
            return spec_
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    supported = ", ".join(a for s in ARCHITECTURES.values() for a in s.hf_architectures)
    raise UnsupportedModelError(f"unsupported architecture {architectures or model_type!r}; supported: {supported}")


def spec_for_gguf(architecture: str) -> ArchSpec:
    for spec_ in ARCHITECTURES.values():
        if architecture in spec_.gguf_architectures:
            return spec_
    supported = ", ".join(a for s in ARCHITECTURES.values() for a in s.gguf_architectures)
    raise UnsupportedModelError(f"unsupported GGUF architecture {architecture!r}; supported: {supported}")
