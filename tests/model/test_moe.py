"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE) from GGUF, and the MoE block's routing.

Tiny random transformers checkpoints are written to GGUF the way llama.cpp's converter writes them (experts
stacked in 3-D tensors, a router per layer, Mixtral as arch "llama" with Q/K permuted), by our own writer below and,
where `make bench-setup` built it, by llama.cpp's `convert_hf_to_gguf.py`. The HF-directory path of the same
architectures is in tests/model/test_model_hf.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hf_to_gguf import llama_cpp_convert, paged_logits, write_hf_as_gguf

from pagedllm.kernels import kernel_mode, kernel_op
from pagedllm.model import load_model
from pagedllm.model.errors import InvalidModelError
from pagedllm.model.moe import SparseMoE, group_by_expert, route

V = 128
ARCHS = {"qwen3moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}  # ours -> GGUF architecture


def hf_moe(arch: str, seed: int = 0, vocab: int = V, dense_layer: bool = True) -> torch.nn.Module:
    """A tiny random transformers model whose activations are O(1) (default init gives near-zero logits).
    dense_layer: Qwen3-MoE's layer 1 dense (mlp_only_layers; llama.cpp's qwen3moe has no dense layers)."""
    import transformers as tf

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)
    if arch == "qwen3moe":  # GGUF qwen3moe renormalises the top k (llama.cpp's graph): so does this checkpoint
        cfg = tf.Qwen3MoeConfig(**common, head_dim=24, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                norm_topk_prob=True, mlp_only_layers=[1] if dense_layer else [])
    elif arch == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    else:
        cfg = tf.OlmoeConfig(**common, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / (1.0 if "embed" in name else p.shape[-1] ** 0.5))
    return model


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, V, n).tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_moe_matches_transformers(tmp_path, arch):
    hf = hf_moe(arch)
    path = str(tmp_path / f"{arch}.gguf")
    write_hf_as_gguf(hf, ARCHS[arch], path)
    ours = load_model(path, "float32", attention_backend="reference", load_tokenizer=False, quantization="none")
    cfg = ours.config
    assert cfg.num_experts == (4 if arch == "mixtral" else 8)
    assert cfg.num_experts_per_tok == hf.config.num_experts_per_tok
    assert cfg.norm_topk_prob == (arch != "olmoe")
    assert cfg.dense_layers == ([1] if arch == "qwen3moe" else [])
    tokens = _tokens(37, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert ref.abs().max() > 1.0  # the comparison means something
    got = paged_logits(ours, tokens)
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", list(ARCHS))
def test_experts_as_stored_match_dequantized(tmp_path, arch):
    """Q8_0 experts run as stored (one quantized GEMM per chosen expert) give the dequantized file's logits,
    within the int8 activations' error."""
    path = str(tmp_path / f"{arch}.q8.gguf")
    write_hf_as_gguf(hf_moe(arch, seed=1), ARCHS[arch], path, Q.Q8_0)
    want = paged_logits(load_model(path, "float32", attention_backend="reference", load_tokenizer=False,
                                   quantization="none"), tokens := _tokens(29, 2))
    stored = load_model(path, "float32", attention_backend="reference", load_tokenizer=False, quantization="gguf")
    from pagedllm.quantization.tensor import QuantTensor

    expert = stored.model.layers[0].mlp.experts[0]
    assert all(isinstance(s, QuantTensor) for s in expert.gate_up.segments + expert.down.segments)
    got = paged_logits(stored, tokens)
    err = (got - want).abs().amax(-1) / want.abs().amax(-1)
    # a near-tie between two experts may go the other way with int8 activations: most rows agree closely
    assert err.median().item() < 0.03, f"relative logit errors {err.tolist()}"


@pytest.mark.slow  # the converter and transformers: about the file, not the kernels (make test-variants skips it)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_llama_cpp_converted_file_matches_transformers(tmp_path, arch):
    out, hf, vocab = llama_cpp_convert(lambda v: hf_moe(arch, vocab=v, dense_layer=False), tmp_path)
    ours = load_model(out, "float32", attention_backend="reference", load_tokenizer=False, quantization="none")
    tokens = np.random.default_rng(3).integers(0, vocab, 23).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (paged_logits(ours, tokens) - ref).abs().max().item() < 1e-4


# ---- bad files -------------------------------------------------------------------------------------------------

def test_expert_count_that_disagrees_with_the_tensors_is_refused(tmp_path):
    path = str(tmp_path / "bad.gguf")
    write_hf_as_gguf(hf_moe("olmoe"), "olmoe", path, expert_count=6)
    with pytest.raises(InvalidModelError, match=r"ffn_gate_inp.weight.*\(8, 64\).*\(6, 64\)"):
        load_model(path, load_tokenizer=False, quantization="none")


def test_top_k_above_the_expert_count_is_refused(tmp_path):
    path = str(tmp_path / "bad.gguf")
    write_hf_as_gguf(hf_moe("mixtral"), "llama", path, expert_used_count=5)
    with pytest.raises(InvalidModelError, match="expert_used_count.*5 experts per token.*expert_count is 4"):
        load_model(path, load_tokenizer=False)


def test_expert_width_that_disagrees_is_refused(tmp_path):
    path = str(tmp_path / "bad.gguf")
    write_hf_as_gguf(hf_moe("qwen3moe"), "qwen3moe", path, expert_feed_forward_length=48)
    with pytest.raises(InvalidModelError, match=r"ffn_\w+_exps.weight'.*\(8, (32, 64|64, 32)\).*\(8, (48, 64|64, 48)\)"):
        load_model(path, load_tokenizer=False)


def test_expert_tensors_without_an_expert_count_are_refused(tmp_path):
    path = str(tmp_path / "bad.gguf")
    write_hf_as_gguf(hf_moe("olmoe"), "olmoe", path, expert_count=None)
    with pytest.raises(InvalidModelError, match="expert_count: missing"):
        load_model(path, load_tokenizer=False)


# ---- routing ---------------------------------------------------------------------------------------------------

def test_route_breaks_ties_by_expert_id_and_renormalises():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    w, e = route(logits, 2, renormalize=False)
    assert e.tolist() == [[1, 2], [0, 1]]
    probs = torch.softmax(logits, -1)
    assert torch.allclose(w, probs.gather(1, e))
    w, _ = route(logits, 2, renormalize=True)
    assert torch.allclose(w, torch.full_like(w, 0.5))


def test_route_with_k_equal_to_the_expert_count():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    w, e = route(logits, 4, renormalize=True)
    assert sorted(e[0].tolist()) == [0, 1, 2, 3]
    assert torch.allclose(w.sum(-1), torch.ones(6))


def test_group_by_expert_covers_every_slot_once_in_token_order():
    experts = torch.tensor([[2, 0], [2, 1], [0, 2]])
    groups = group_by_expert(experts, 4)
    assert [(e, idx.tolist()) for e, idx in groups] == [(0, [1, 4]), (1, [3]), (2, [0, 2, 5])]  # expert 3: none


def _moe(num_experts: int, top_k: int, seed: int) -> SparseMoE:
    moe = SparseMoE(16, 24, num_experts, top_k, renormalize=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return moe


def _reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token in float64: the sum over its chosen experts of weight x expert(x)."""
    out = []
    for row in x.double():
        logits = row @ moe.router.weight.double().t()
        w, e = route(logits[None], moe.top_k, moe.renormalize)
        acc = torch.zeros_like(row)
        for weight, expert in zip(w[0].tolist(), e[0].tolist(), strict=True):
            mlp = moe.experts[expert]
            gu = row @ mlp.gate_up.weight.double().t()
            act = torch.nn.functional.silu(gu[:mlp.intermediate]) * gu[mlp.intermediate:]
            acc += weight * (act @ mlp.down.weight.double().t())
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("case", ["random", "all_pick_one", "k_equals_experts", "lone_expert"])
def test_moe_block_rows_are_the_same_alone_and_batched(case):
    """Each token's output equals the float64 per-token reference, and is bitwise the same computed alone as in
    any batch (invariant kernels): every token picking one expert, top-k = every expert, and one token whose
    expert nobody else picked."""
    g = torch.Generator().manual_seed(1)
    moe = _moe(4 if case == "k_equals_experts" else 6, 4 if case == "k_equals_experts" else 2, seed=2)
    x = torch.randn(9, 16, generator=g)
    if case == "all_pick_one":  # a router that favours expert 3 for everyone
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[3] = x.mean(0) * 10
            moe.router.weight[1] = x.mean(0) * 5
        x = x + 2 * x.mean(0)
    with torch.no_grad(), kernel_mode(invariant=True):
        batched = moe(x)
        alone = torch.cat([moe(x[i:i + 1]) for i in range(len(x))])
        reordered = moe(x.flip(0)).flip(0)
    _, experts = route(x @ moe.router.weight.t(), moe.top_k, True)
    if case == "all_pick_one":
        assert (experts[:, 0] == 3).all()
    if case == "lone_expert":
        counts = torch.bincount(experts.reshape(-1), minlength=6)
        assert (counts == 1).any(), counts.tolist()
    assert torch.equal(batched, alone) and torch.equal(batched, reordered)
    assert (batched.double() - _reference(moe, x)).abs().max().item() < 1e-5


# ---- random-weight files of real MoE shapes (`pagedllm bench make-model`) ---------------------------------------

def _tiny_moe_shape(arch: str):
    from pagedllm.testing.gguf_writer import tiny_shape

    return tiny_shape(arch, experts=8, experts_used=2, expert_ffn=256, qk_norm=arch == "qwen3moe", layers=3,
                      tied=False, **({"ffn": 256} if arch == "llama" else {}))


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_q4_k_m_file_runs_as_stored_in_its_own_bytes(tmp_path, arch):
    """A Q4_K_M file of an MoE shape (typed as llama-quantize types it) loads as stored: every matrix and the
    embedding stay in the file's blocks (resident weights within 10% of the file), and its logits match the
    dequantized file's."""
    from pagedllm.model.linear import Linear
    from pagedllm.model.quantized_linear import weight_bytes
    from pagedllm.quantization.tensor import QuantTensor
    from pagedllm.testing.gguf_writer import write_random_gguf

    path = str(tmp_path / f"{arch}.gguf")
    write_random_gguf(path, _tiny_moe_shape(arch), "Q4_K_M", seed=4, tokenizer_from=None, std=0.1)
    stored = load_model(path, "float32", attention_backend="reference", load_tokenizer=False, quantization="gguf")
    assert stored.config.num_experts == 8 and stored.config.num_experts_per_tok == 2
    assert isinstance(stored.model.embed, QuantTensor)
    linears = [m for m in stored.model.modules() if isinstance(m, Linear)]
    routers = {id(layer.mlp.router) for layer in stored.model.layers}  # F32 in the file, as llama-quantize leaves them
    assert all(isinstance(s, QuantTensor) for m in linears if id(m) not in routers for s in m.segments)
    resident = sum(weight_bytes(m) for m in linears) + stored.model.embed.nbytes
    resident += sum(p.numel() * p.element_size() for p in stored.model.parameters())
    assert resident <= 1.1 * os.path.getsize(path)
    want = paged_logits(load_model(path, "float32", attention_backend="reference", load_tokenizer=False,
                                   quantization="none"), tokens := _tokens(25, 5))
    err = (paged_logits(stored, tokens) - want).abs().amax(-1) / want.abs().amax(-1)
    # int8 activations through three layers of random K-quant weights; a near-tie of two experts may flip
    assert err.median().item() < 0.06, f"relative logit errors {err.tolist()}"


def test_moe_files_are_typed_as_llama_quantize_types_them():
    from pagedllm.testing.gguf_writer import tensor_type

    assert tensor_type("Q4_K_M", "ffn_gate_inp", 0, 48, 2048, experts=128) == "F32"
    assert tensor_type("Q4_K_M", "ffn_gate_exps", 0, 48, 2048, experts=128) == "Q4_K"
    assert tensor_type("Q4_K_M", "ffn_down_exps", 0, 48, 768, experts=128) == "Q6_K"  # a more-bits layer
    assert tensor_type("Q4_K_M", "ffn_down_exps", 7, 48, 768, experts=128) == "Q4_K"
    assert tensor_type("Q4_K_M", "attn_v", 7, 32, 4096, experts=8) == "Q8_0"  # llama-quantize's 8-expert rule


# ---- the C++ form (csrc/moe.cpp) against the Python one ----------------------------------------------------------

def _quantized_moe(gate_up_type: str, down_type: str, glu, bias: bool, seed: int, E: int = 6, k: int = 3,
                   H: int = 256, intermediate: int = 256, dtype: torch.dtype = torch.float32) -> SparseMoE:
    """A SparseMoE whose experts hold random GGUF blocks of the given types, as a GGUF file loads them."""
    from pagedllm.model.quantized_linear import QuantizedLinearMethod
    from pagedllm.quantization.tensor import QuantTensor, type_id
    from pagedllm.testing.gguf_writer import quantized

    rng = np.random.default_rng(seed)
    method = QuantizedLinearMethod()
    moe = SparseMoE(H, intermediate, E, k, renormalize=True, dtype=dtype, method=method, glu=glu, bias=bias)

    def blocks(rows: int, cols: int, qtype: str) -> QuantTensor:
        return QuantTensor(torch.from_numpy(quantized(rng, rows, cols, qtype, 0.5).view(np.uint8).reshape(rows, -1)),
                           type_id(qtype), cols)

    moe.router.load_weight("weight", torch.from_numpy(rng.standard_normal((E, H), dtype=np.float32)).to(dtype), None,
                           "router")
    moe.router.method.process_weights_after_loading(moe.router)
    if bias:  # (created uninitialised, as every weight before it loads)
        with torch.no_grad():
            moe.router.bias.copy_(torch.from_numpy(rng.standard_normal(E, dtype=np.float32)) * 0.1)
    for e, mlp in enumerate(moe.experts):
        for shard in (0, 1):
            mlp.gate_up.load_weight("weight", blocks(intermediate, H, gate_up_type), shard, f"gate_up.{e}")
        mlp.down.load_weight("weight", blocks(H, intermediate, down_type), None, f"down.{e}")
        for lin in (mlp.gate_up, mlp.down):
            lin.method.process_weights_after_loading(lin)
            if bias:
                with torch.no_grad():
                    lin.bias.copy_(torch.from_numpy(rng.standard_normal(lin.output_size, dtype=np.float32)) * 0.1)
    return moe


@pytest.mark.parametrize("types,gpt_oss", [(("Q4_K", "Q6_K"), False), (("Q8_0", "Q4_0"), False),
                                            (("MXFP4", "MXFP4"), True)])
def test_experts_in_one_call_match_the_python_form_and_are_batch_invariant(types, gpt_oss):
    """The C++ MoE (every expert's blocks in one call) against the Python form of the same steps on random GGUF
    experts (Qwen3-MoE's types; gpt-oss's MXFP4 with biases and the clamped SwiGLU): close (both quantize the
    activations to int8; the two SwiGLUs round differently), and a token's row bitwise the same alone, in a batch,
    in another order."""
    from pagedllm.model.mlp import clamped_swiglu, swiglu

    glu = clamped_swiglu(7.0, 1.702) if gpt_oss else swiglu
    moe = _quantized_moe(*types, glu, bias=gpt_oss, seed=3)
    moe_bf16 = _quantized_moe(*types, glu, bias=gpt_oss, seed=3, dtype=torch.bfloat16)
    # 30 rows: ~15 per expert (one expert after another); 4 rows: a few (side by side, csrc/moe.cpp); 1 row
    x = torch.randn(30, 256, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), kernel_mode(invariant=True):
        batched = moe(x)
        assert moe._table is not None, "the experts' blocks should run in one call"
        alone = torch.cat([moe(x[i:i + 1]) for i in range(len(x))])
        reordered = moe(x.flip(0)).flip(0)
        assert torch.equal(torch.cat([moe(x[i:i + 4]) for i in range(0, len(x), 4)]), batched)
        xb = x.bfloat16()  # a bf16 model (where the CPU has avx512_bf16): fp32 inside, rounded once
        assert torch.equal(moe_bf16(xb), torch.cat([moe_bf16(xb[i:i + 1]) for i in range(len(xb))]))
        assert moe_bf16._table is not None
        moe._table = None  # the Python form
        python = moe(x)
        python_alone = torch.cat([moe(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(batched, alone) and torch.equal(batched, reordered)
    assert torch.equal(python, python_alone)
    err = (batched - python).norm(dim=-1) / python.norm(dim=-1)
    assert err.max().item() < 1e-3, err.tolist()


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral", "gpt-oss"])
def test_fused_layers_with_experts_match_the_torch_layers(tmp_path, arch):
    """The fused C++ layer stack with mixtures of experts (the router, each token's routing and its experts in
    C++; Qwen3-MoE with a dense layer between sparse ones; gpt-oss's MXFP4 experts with biases and the clamped
    SwiGLU, sinks, windowed layers, YaRN) against the same model's torch layers, as stored: close to the int8
    activations' error; and a prompt's rows the same bits in one step as in a prefill and one-token steps."""
    from pagedllm.kernels import dispatch
    from pagedllm.model.fused_layer import fuses_layers
    from pagedllm.model.kv_cache import allocate_kv_caches
    from pagedllm.testing.gguf_writer import tiny_shape, write_random_gguf

    if dispatch.kernel_class("DecoderStack") is None or kernel_op("moe_experts") is None:
        pytest.skip("no fused layer or C++ experts on this build")
    path = str(tmp_path / f"{arch}.gguf")
    if arch == "gpt-oss":
        shape = tiny_shape("gpt-oss", experts=4, experts_used=2, expert_ffn=256, sliding_window=16, yarn=(4.0, 256),
                           layers=2, vocab=V)
        write_random_gguf(path, shape, "MXFP4_MOE", seed=5, tokenizer_from=None, std=0.1)
    else:
        write_hf_as_gguf(hf_moe(arch, seed=2), ARCHS[arch], path, Q.Q8_0)
    loaded = load_model(path, "float32", attention_backend="cpu", load_tokenizer=False, quantization="gguf")
    tokens = _tokens(37, 6)
    with kernel_mode(invariant=True):
        h = torch.empty(len(tokens), loaded.config.hidden_size)
        assert fuses_layers(loaded.model, h, allocate_kv_caches(loaded.config, 16, torch.float32, num_blocks=4))
        fused = paged_logits(loaded, tokens)
        decode = paged_logits(loaded, tokens, [30] + [1] * 7)  # a prompt, then one-token steps
        loaded.model.fused_layers = False
        plain = paged_logits(loaded, tokens)
    assert float(fused.abs().max()) > 1.0  # the comparison means something
    err = (fused - plain).abs().amax(-1) / plain.abs().amax(-1)
    # int8 activations rounded differently by the two paths' pointwise stages: a near-tie of two experts may flip
    assert err.median().item() < 0.02, f"relative logit errors {err.tolist()}"
    assert torch.equal(fused, decode), "a token's rows depend on how its prompt was split into steps"
