"""Models on GGUF weights run as stored (quantization="gguf"; "auto" where the kernels have VNNI) against the same file dequantized ("none", the
oracle), on tiny random-weight files of every type; memory stays the file's; the int8 mode on HF checkpoints."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import build_attention_metadata
from pagedllm.kernels import kernel_mode
from pagedllm.model import allocate_kv_caches, load_model
from pagedllm.model.linear import Linear
from pagedllm.model.quantized_linear import QuantizedLinearMethod, weight_bytes
from pagedllm.quantization.tensor import QuantTensor, kernel_available
from pagedllm.testing.gguf_writer import FILE_TYPES, tiny_shape, write_random_gguf

pytestmark = pytest.mark.skipif(not kernel_available(), reason="the C++ kernels could not be built")

BS = 16


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("quant-gguf")


def _file(gguf_dir, file_type: str, arch: str = "llama") -> str:
    path = gguf_dir / f"tiny-{arch}-{file_type}.gguf"
    if not path.exists():
        write_random_gguf(str(path), tiny_shape(arch), file_type, seed=3, tokenizer_from=None)
    return str(path)


def _prefill_logits(loaded, tokens: list[int], dtype=torch.float32) -> torch.Tensor:
    kv = allocate_kv_caches(loaded.config, BS, dtype, num_blocks=8)
    meta = build_attention_metadata([list(range(-(-len(tokens) // BS)))], [0], [len(tokens)], BS)
    ids, pos = torch.tensor(tokens), torch.arange(len(tokens))
    return loaded.model.compute_logits(loaded.model(ids, pos, kv, meta))


def _load(path: str, quantization: str, dtype: str = "float32"):
    return load_model(path, dtype, attention_backend="reference", load_tokenizer=False, quantization=quantization)


@pytest.mark.parametrize("file_type", [t for t in FILE_TYPES if t not in ("F32", "F16", "BF16")])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_close_to_dequantized(gguf_dir, file_type, arch):
    if arch == "qwen2" and file_type not in ("Q4_0", "Q4_K_M"):
        pytest.skip("qwen2 (biases, tied head) on two types is enough")
    path = _file(gguf_dir, file_type, arch)
    quant, oracle = _load(path, "gguf"), _load(path, "none")
    layer = quant.model.layers[0].attn.qkv
    assert isinstance(layer.method, QuantizedLinearMethod) and all(isinstance(s, QuantTensor) for s in layer.segments)
    tokens = [int(t) for t in torch.randint(0, 320, (21,), generator=torch.Generator().manual_seed(5))]
    got, want = _prefill_logits(quant, tokens), _prefill_logits(oracle, tokens)
    # the only difference is the int8 rounding of activations inside each linear
    err = (got - want).abs().max() / want.abs().max()
    assert err < 0.03, f"relative logit error {err:.4f}"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_bf16_model_runs_quantized(gguf_dir):
    path = _file(gguf_dir, "Q4_0")
    quant, oracle = _load(path, "gguf", "bfloat16"), _load(path, "none", "float32")
    tokens = list(range(3, 40))
    got, want = _prefill_logits(quant, tokens, torch.bfloat16), _prefill_logits(oracle, tokens)
    assert float((got - want).abs().max() / want.abs().max()) < 0.06


def test_resident_weights_are_the_files(gguf_dir):
    """Every linear and the embedding stay in their stored bytes: nothing of full precision but the norms."""
    import os

    path = _file(gguf_dir, "Q4_K_M")
    quant = _load(path, "gguf")
    linear_bytes = sum(weight_bytes(m) for m in quant.model.modules() if isinstance(m, Linear))
    embed = quant.model.embed
    assert isinstance(embed, QuantTensor)
    dense = sum(p.numel() * p.element_size() for p in quant.model.parameters())  # norms (and biases)
    assert linear_bytes + embed.nbytes + dense <= 1.1 * os.path.getsize(path)


def test_float_files_stay_dense(gguf_dir):
    path = _file(gguf_dir, "F16")
    quant = _load(path, "gguf")
    assert all(isinstance(s, torch.Tensor) for s in quant.model.layers[0].mlp.gate_up.segments)
    tokens = list(range(5, 30))
    torch.testing.assert_close(_prefill_logits(quant, tokens), _prefill_logits(_load(path, "none"), tokens))


def test_int8_on_hf_checkpoint(tmp_path):
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "hf", "llama", seed=1)
    int8, dense = _load(str(path), "int8"), _load(str(path), "none")
    assert all(isinstance(s, QuantTensor) and s.type_name == "Q8_0" for s in int8.model.layers[0].attn.qkv.segments)
    tokens = list(range(7, 30))
    got, want = _prefill_logits(int8, tokens), _prefill_logits(dense, tokens)
    assert float((got - want).abs().max() / want.abs().max()) < 0.03


def test_unknown_quantization_is_rejected(gguf_dir):
    with pytest.raises(ValueError, match="quantization"):
        _load(_file(gguf_dir, "Q8_0"), "fp4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_layer_matches_torch_layers(gguf_dir, dtype):
    """The fused C++ decoder layer on quantized segments (C++ attention) against the same model's torch layers:
    same kernels for the linears, so close to the dtype's rounding (and the int8 activations' re-rounding)."""
    from pagedllm.kernels import dispatch
    from pagedllm.model.fused_layer import fuses_layers

    if dtype == torch.bfloat16 and not dispatch.has(dispatch.AVX512_BF16):
        pytest.skip("no avx512_bf16 fused layer on this build")
    if dispatch.kernel_class("DecoderStack") is None:
        pytest.skip("no AVX-512 fused layer on this build")
    path = _file(gguf_dir, "Q4_K_M")
    m = load_model(path, dtype, attention_backend="cpu", load_tokenizer=False, quantization="gguf")
    assert any(lin.method.segmented for lin in m.model.layers[0].linears())
    tokens = list(range(11, 40))
    with kernel_mode(invariant=dtype == torch.float32):  # the fp32 layer also runs batch-invariant; the bf16 one does not
        h = torch.empty(len(tokens), m.config.hidden_size, dtype=dtype)
        assert fuses_layers(m.model, h, allocate_kv_caches(m.config, 16, dtype, num_blocks=4))
        fused = _prefill_logits(m, tokens, dtype)
        m.model.fused_layers = False
        plain = _prefill_logits(m, tokens, dtype)
    assert float((fused - plain).abs().max() / plain.abs().max()) < 0.02
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9


def test_fused_stack_in_runs_of_layers_is_the_same_as_in_one_call(gguf_dir):
    """Layers that get their own attention metadata (KV groups) run in one DecoderStack call per run of layers
    (`first`, `count` pick them): the same bits as all layers in one call. The call rejects what does not fit the
    stack."""
    import dataclasses

    from pagedllm.kernels import dispatch

    if dispatch.kernel_class("DecoderStack") is None:
        pytest.skip("no AVX-512 fused layer on this build")
    m = load_model(_file(gguf_dir, "Q4_K_M", "qwen2"), torch.float32, attention_backend="cpu", load_tokenizer=False,
                   quantization="gguf")
    n = len(m.model.layers)
    g = torch.Generator().manual_seed(17)
    tokens = torch.randint(0, 320, (19,), generator=g)
    meta = build_attention_metadata([[3, 0]], [0], [len(tokens)], BS)
    results = []
    for metas in (meta, [dataclasses.replace(meta) for _ in range(n)]):  # one run; n runs of one layer
        kv = allocate_kv_caches(m.config, BS, torch.float32, num_blocks=4)
        kv.pool.normal_(generator=torch.Generator().manual_seed(3))  # fresh garbage in the blocks not written
        with kernel_mode(invariant=True):
            results.append((m.model(tokens, torch.arange(len(tokens)), kv, metas), kv.pool.clone()))
    (h1, kv1), (hn, kvn) = results
    assert torch.equal(h1, hn) and torch.equal(kv1, kvn)

    stack = m.model._decoder_stack
    h = torch.randn(2, m.config.hidden_size, generator=g)
    cos = sin = torch.ones(2, m.config.head_dim)
    kv = allocate_kv_caches(m.config, BS, torch.float32, num_blocks=4)
    args = (torch.tensor([0, 1]), torch.tensor([[0]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
            torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="layers 1..3 of 2"):
        stack.forward(h, cos, sin, kv.pool, kv.pool_rows, *args, 1, 2, True)
    with pytest.raises(RuntimeError, match="BFloat16"):  # weights of another dtype (or no bf16 layer)
        stack.forward(h.bfloat16(), cos.bfloat16(), sin.bfloat16(), kv.pool, kv.pool_rows, *args, 0, n, True)
    with pytest.raises(RuntimeError, match="slot 99 out of range"):
        stack.forward(h, cos, sin, kv.pool, kv.pool_rows, torch.tensor([0, 99]), *args[1:], 0, n, True)
    with pytest.raises(RuntimeError, match="layer 1's pool row 7 out of range"):
        stack.forward(h, cos, sin, kv.pool, torch.tensor([0, 7]), *args, 0, n, True)
    with pytest.raises(RuntimeError, match="KV pool must be contiguous"):
        stack.forward(h, cos, sin, kv.pool[:, :1], kv.pool_rows, *args, 0, n, True)


def _mix(shape_name: str, file_type: str = "Q4_K_M") -> dict[str, int]:
    from collections import Counter

    from pagedllm.testing.gguf_writer import SHAPES, tensor_type

    s = SHAPES[shape_name]
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    names = [("token_embd", 0, s.hidden)] + [(n, i, cols) for i in range(s.layers) for n, cols in (
        ("attn_q", s.hidden), ("attn_k", s.hidden), ("attn_v", s.hidden), ("attn_output", q),
        ("ffn_gate", s.hidden), ("ffn_up", s.hidden), ("ffn_down", s.ffn))]
    assert kv > 0
    return dict(Counter(tensor_type(file_type, n, i, s.layers, cols, s.tied) for n, i, cols in names))


def test_q4_k_m_is_typed_as_llama_quantize_types_it():
    """The tensor types of real Q4_K_M files of these shapes (Qwen2.5 0.5B: 896-wide rows fall back from Q4_K to
    Q5_0 and from Q6_K to Q8_0, the tied embedding is the output head: Q8_0; 1.5B: Q4_K and Q6_K only). The real
    files counted in issue 29 list one more Q4_K-class matrix each (133 Q5_0, 169 Q4_K) than their 1 + 7 x layers
    matrices hold."""
    assert _mix("qwen2.5-0.5b") == {"Q8_0": 13, "Q5_0": 132, "Q6_K": 12, "Q4_K": 12}
    assert _mix("qwen2.5-1.5b") == {"Q6_K": 29, "Q4_K": 168}


def test_q3_k_m_is_typed_as_llama_quantize_types_it():
    """The counts llama-quantize (llama.cpp 0c1e570) wrote for Q3_K_M from F16 files of these shapes, every tensor
    the same type as make-model's. 0.5B: Q3_K falls back to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1 (attn_v of layers 0
    and 1), except ffn_down (4,864 wide: Q5_K in layer 0, Q4_K after); 1.5B: no fallbacks."""
    assert _mix("qwen2.5-0.5b", "Q3_K_M") == {"Q8_0": 1, "Q4_0": 96, "Q5_1": 2, "Q5_0": 46, "Q5_K": 1, "Q4_K": 23}
    assert _mix("qwen2.5-1.5b", "Q3_K_M") == {"Q6_K": 1, "Q3_K": 112, "Q5_K": 3, "Q4_K": 81}


def test_q5_k_m_is_typed_as_llama_quantize_types_it():
    """Q5_K_M is Q4_K_M's mix with Q5_K for Q4_K: the counts llama-quantize (llama.cpp 0c1e570) wrote for the 0.5B
    shape from an F16 file (Q5_K falls back to Q5_1 on 896-wide rows), every tensor the same type as make-model's."""
    assert _mix("qwen2.5-0.5b", "Q5_K_M") == {"Q8_0": 13, "Q5_1": 132, "Q6_K": 12, "Q5_K": 12}


def test_vocabulary_is_padded_to_the_shape(tmp_path):
    """A shape's vocabulary larger than the embedded tokenizer's: the token list is padded with unused tokens, and
    the model loads and runs on the file."""
    from pagedllm.model.gguf_reader import read_gguf

    path = str(tmp_path / "padded.gguf")
    vocab = 49152 + 48
    write_random_gguf(path, tiny_shape("qwen2", vocab=vocab), "Q4_K_M", seed=4)
    from gguf import GGUFReader

    tokens = GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == vocab and tokens[-1] == f"<|unused_{vocab - 1}|>"
    f = read_gguf(path)
    assert f.tensors["token_embd.weight"].shape == (vocab, 256)
    loaded = _load(path, "gguf")
    assert _prefill_logits(loaded, [1, 2, 3]).shape == (3, vocab)
