"""The fused C++ decoder layer (bf16 on the C++ backend) against the model's layer-by-layer torch path, for decode
steps of a few tokens (small-GEMM kernel) and prefill-sized batches (oneDNN matmul, parallel pointwise stages), and
in batch-invariant mode (the default: the invariant GEMM in both). Both layer styles: Llama's, and Gemma 3's (norms
by 1 + w, output norms, GeGLU, sliding windows with their own RoPE base)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import build_attention_metadata
from pagedllm.kernels import dispatch, kernel_mode
from pagedllm.model import ModelConfig, allocate_kv_caches
from pagedllm.model.fused_layer import fuses_layers
from pagedllm.model.gemma3 import Gemma3ForCausalLM
from pagedllm.model.llama import LlamaForCausalLM

BLOCK = 16

CONFIGS = {
    "smollm2-shaped": dict(hidden_size=192, intermediate_size=512, num_heads=3, num_kv_heads=1, head_dim=64),
    "bias+o_bias": dict(hidden_size=128, intermediate_size=320, num_heads=4, num_kv_heads=2, head_dim=32,
                        qkv_bias=True, o_bias=True),
    "qk_norm, head_dim 16": dict(hidden_size=96, intermediate_size=200, num_heads=6, num_kv_heads=2,
                                 head_dim=16, qk_norm=True),
    "llama3 rope, MHA": dict(hidden_size=256, intermediate_size=384, num_heads=2, num_kv_heads=2, head_dim=128,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # a sliding layer then a full one; windows that bind in the longer contexts below
    "gemma3, window 24": dict(architecture="gemma3", hidden_size=160, intermediate_size=448, num_heads=4,
                              num_kv_heads=1, head_dim=64, qk_norm=True, sliding_window=24,
                              layer_types=["sliding_attention", "full_attention"], rope_local_theta=10000.0,
                              rope_theta=1e6, query_pre_attn_scalar=48.0),
    "mistral, window 40": dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32,
                               sliding_window=40),
}

# the batch-dependent fast paths (batch-invariant mode, the default, does not use them)
pytestmark = pytest.mark.usefixtures("batch_dependent_kernels")


def random_model(name: str, seed: int) -> LlamaForCausalLM | Gemma3ForCausalLM:
    if dispatch.kernel_class("DecoderStack") is None or not dispatch.has(dispatch.AVX512_BF16):
        pytest.skip("no avx512_bf16 kernels on this CPU")
    kw = {"architecture": "llama", **CONFIGS[name]}
    cfg = ModelConfig(num_layers=2, vocab_size=300, max_position_embeddings=4096, rms_norm_eps=1e-5, **kw)
    gemma = cfg.architecture == "gemma3"
    model = (Gemma3ForCausalLM if gemma else LlamaForCausalLM)(cfg, torch.bfloat16, attention_backend="cpu")
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.data = (torch.randn(p.shape, generator=g) * (1.0 if p.dim() == 1 else 0.08)).bfloat16()
    for mod_name, mod in model.named_modules():  # norms that scale by about 1, as trained models' do
        if mod_name.endswith("norm") and "layers." in mod_name:  # Gemma's scale by 1 + w
            mod.weight.data = (int(not gemma) + 0.2 * torch.randn(mod.weight.shape, generator=g)).bfloat16()
    return model


def fill_context(model, caches, g, context_lens: list[int]) -> list[list[int]]:
    """Prefill each request's context through the torch path; blocks drawn in a scattered order."""
    num_blocks = caches[0][0].shape[0]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in context_lens:
        need = -(-(n + 300) // BLOCK)
        tables.append([perm.pop() for _ in range(need)])
    ids = torch.randint(0, model.config.vocab_size, (sum(context_lens),), generator=g)
    meta = build_attention_metadata(tables, [0] * len(context_lens), context_lens, BLOCK)
    positions = torch.cat([torch.arange(n) for n in context_lens])
    model.fused_layers = False
    model(ids, positions, caches, meta)
    return tables


@pytest.mark.parametrize("invariant", [False, True], ids=["batch-dependent", "invariant"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("context_lens,new", [([37], [1]), ([5, 130, 16], [1, 1, 1]), ([64, 9], [2, 1]),
                                              ([200], [4]), ([0, 31], [3, 1]), ([0, 40, 0], [77, 5, 130]),
                                              ([0], [300])])
def test_fused_layers_match_torch_layers(invariant, name, context_lens, new):
    with kernel_mode(invariant=invariant):
        check_fused_matches_torch(name, context_lens, new)


def check_fused_matches_torch(name: str, context_lens: list[int], new: list[int]) -> None:
    seed = sum(context_lens) * 10 + len(new)
    model = random_model(name, seed)
    g = torch.Generator().manual_seed(seed)
    caches = allocate_kv_caches(model.config, BLOCK, torch.bfloat16, num_blocks=96)
    tables = fill_context(model, caches, g, context_lens)
    pool_before = caches.pool.clone()
    ids = torch.randint(0, model.config.vocab_size, (sum(new),), generator=g)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(context_lens, new, strict=True)])
    meta = build_attention_metadata(tables, context_lens, new, BLOCK)

    results = {}
    for fused in (False, True):
        caches.pool.copy_(pool_before)
        model.fused_layers = fused
        if fused:
            assert fuses_layers(model, torch.empty(sum(new), 1, dtype=torch.bfloat16), caches)
        hidden = model(ids, positions, caches, meta).float()
        results[fused] = hidden, caches.pool.clone().float()
    (h_ref, kv_ref), (h_fused, kv_fused) = results[False], results[True]
    # same arithmetic up to summation order: a bf16 ulp here and there, never a wrong row
    assert torch.allclose(h_fused, h_ref, rtol=2e-2, atol=2e-2 * h_ref.abs().max().item())
    assert (h_fused - h_ref).abs().mean() < 2e-3 * h_ref.abs().mean()
    assert torch.allclose(kv_fused, kv_ref, rtol=2e-2, atol=2e-2)
    written = (kv_ref != pool_before.float()).any(-1).any(-1).sum().item()
    assert written >= sum(new)  # the step did write new K/V (so the comparison above covers them)
    unwritten = (kv_fused == pool_before.float()).all(-1).all(-1)
    assert unwritten.sum().item() == unwritten.numel() - written


def test_fused_path_only_for_bf16_on_the_cpu_kernel():
    model = random_model("smollm2-shaped", 1)
    caches = allocate_kv_caches(model.config, BLOCK, torch.bfloat16, num_blocks=4)
    h = torch.empty(1, 192, dtype=torch.bfloat16)
    assert fuses_layers(model, h, caches)
    assert fuses_layers(model, torch.empty(500, 192, dtype=torch.bfloat16), caches)
    assert not fuses_layers(model, h.float(), caches)
    model.fused_layers = False
    assert not fuses_layers(model, h, caches)
    model.fused_layers = True
    with kernel_mode(invariant=True):  # with the invariant GEMM: the default mode's path on this CPU
        assert fuses_layers(model, h, caches)
    with kernel_mode(portable=True):  # the portable attention path: the torch layers
        assert not fuses_layers(model, h, caches)
    model.set_attention_backend("reference")
    assert not fuses_layers(model, h, caches)


def test_bad_slot_is_an_error_not_a_write_out_of_bounds():
    model = random_model("smollm2-shaped", 2)
    caches = allocate_kv_caches(model.config, BLOCK, torch.bfloat16, num_blocks=2)
    meta = build_attention_metadata([[0]], [3], [1], BLOCK)
    meta.slot_mapping = torch.tensor([2 * BLOCK + 5])
    with pytest.raises(RuntimeError, match="out of range"):
        model(torch.tensor([7]), torch.tensor([3]), caches, meta)
