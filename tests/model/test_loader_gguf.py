"""GGUF loading vs transformers loading the same file (its own reader and dequantiser are the oracle):
tiny Llama / Qwen2 / Qwen3 files written with the gguf package in every supported tensor type; clear errors."""

from __future__ import annotations

import gc

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hf_to_gguf import paged_logits
from tiny_models import fresh_seed, hf_model_from_gguf

from pagedllm.kernels import kernel_mode
from pagedllm.model import UnsupportedModelError, load_model
from pagedllm.model.errors import InvalidModelError

H, FFN, V, LAYERS = 256, 512, 256, 2  # rows of 256: K-quants need it
# heads per arch; qwen3 keeps head_dim 128 because transformers' GGUF path ignores qwen3.attention.key_length
HEADS = {"llama": (4, 2), "qwen2": (4, 2), "qwen3": (2, 1)}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows of llama models (so the loader must undo it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _kquant_bytes(rng: np.random.Generator, rows: int, cols: int, qt: Q) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantise to them) with sane fp16 scales."""
    nblk = rows * cols // 256
    if qt == Q.Q4_K:
        b = rng.integers(0, 256, (nblk, 144), dtype=np.uint8)
        b[:, 0:2] = np.frombuffer(rng.uniform(0.001, 0.004, nblk).astype(np.float16).tobytes(),
                                  np.uint8).reshape(nblk, 2)
        b[:, 2:4] = np.frombuffer(rng.uniform(0.001, 0.004, nblk).astype(np.float16).tobytes(),
                                  np.uint8).reshape(nblk, 2)
    else:  # Q6_K: scales are int8, d is the fp16 at the end
        b = rng.integers(0, 256, (nblk, 210), dtype=np.uint8)
        b[:, 208:210] = np.frombuffer(rng.uniform(0.0005, 0.002, nblk).astype(np.float16).tobytes(),
                                      np.uint8).reshape(nblk, 2)
    return b.reshape(rows, -1)


def write_gguf(path: str, arch: str, types: dict[str, Q], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    NH, NKV = HEADS.get(arch, (4, 2))  # noqa: N806
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(H // NH)
    if arch == "qwen3":
        w.add_key_length(H // NH)
        w.add_value_length(H // NH)

    def rnd(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def add(name: str, arr: np.ndarray, role: str | None = None) -> None:
        qt = types.get(role, Q.F32) if role else Q.F32
        if qt in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(name, _kquant_bytes(rng, *arr.shape, qt), raw_dtype=qt)
        elif qt == Q.F32:
            w.add_tensor(name, arr)
        elif qt == Q.Q8_1:  # a type we do not support: random blocks are enough to get rejected
            blk, nbytes = gguf.GGML_QUANT_SIZES[qt]
            raw = rng.integers(0, 256, (arr.shape[0], arr.shape[1] // blk * nbytes), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qt)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    add("token_embd.weight", rnd(V, H) * 16, "embed")
    add("output_norm.weight", norm(H))
    if arch != "llama":  # llama: tied embeddings, like SmolLM2
        add("output.weight", rnd(V, H), "out")
    kv = H * NKV // NH
    for i in range(LAYERS):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", norm(H))
        add(p + "ffn_norm.weight", norm(H))
        q, k = rnd(H, H), rnd(kv, H)
        if arch == "llama":
            q, k = _permute(q, NH), _permute(k, NKV)
        add(p + "attn_q.weight", q, "q")
        add(p + "attn_k.weight", k, "k")
        add(p + "attn_v.weight", rnd(kv, H), "v")
        add(p + "attn_output.weight", rnd(H, H), "o")
        add(p + "ffn_gate.weight", rnd(FFN, H), "gate")
        add(p + "ffn_up.weight", rnd(FFN, H), "up")
        add(p + "ffn_down.weight", rnd(H, FFN), "down")
        if arch == "qwen2":
            for x, n in (("q", H), ("k", kv), ("v", kv)):
                add(p + f"attn_{x}.bias", 0.3 * rng.standard_normal(n).astype(np.float32))
        if arch == "qwen3":
            add(p + "attn_q_norm.weight", norm(H // NH))
            add(p + "attn_k_norm.weight", norm(H // NH))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TYPE_SETS = {
    "float": {"embed": Q.F16, "out": Q.BF16, "q": Q.F32, "k": Q.F16, "v": Q.BF16, "o": Q.F16, "gate": Q.BF16,
              "up": Q.F32, "down": Q.F16},
    "q32": {"embed": Q.Q8_0, "out": Q.Q8_0, "q": Q.Q4_1, "k": Q.Q4_0, "v": Q.Q8_0, "o": Q.Q4_0, "gate": Q.Q4_1,
            "up": Q.Q8_0, "down": Q.Q4_1},
    "kquant": {"embed": Q.Q6_K, "out": Q.Q6_K, "q": Q.Q4_K, "k": Q.Q6_K, "v": Q.Q4_K, "o": Q.Q6_K,
               "gate": Q.Q4_K, "up": Q.Q6_K, "down": Q.Q4_K},
}


@pytest.mark.parametrize("types", list(TYPE_SETS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_matches_transformers(tmp_path, arch, types):
    path = tmp_path / "m.gguf"
    write_gguf(str(path), arch, TYPE_SETS[types])
    # the dequantized path is the one that equals transformers;
    # tests/model/test_quant_model.py compares the two
    ours = load_model(str(path), "float32", attention_backend="reference", load_tokenizer=False,
                      quantization="none")
    assert ours.config.architecture == arch
    assert ours.config.tie_word_embeddings == (arch == "llama")
    assert ours.config.qkv_bias == (arch == "qwen2") and ours.config.qk_norm == (arch == "qwen3")
    tokens = np.random.default_rng(1).integers(0, V, 37).tolist()
    ref = {}
    for dtype in (torch.float32, torch.float64):
        hf = hf_model_from_gguf(str(path), dtype)
        with torch.no_grad():
            ref[dtype] = hf(torch.tensor([tokens])).logits[0].double()
    assert ref[torch.float32].abs().max() > 1.0  # the comparison means something
    # batch-dependent kernels run transformers' own fp32 ops (F.linear): the same logits
    with kernel_mode(invariant=False):
        got = paged_logits(ours, tokens).double()
    assert (got - ref[torch.float32]).abs().max().item() < 1e-4
    # the batch-invariant GEMM sums in another order: measured against float64, it must be as accurate as
    # transformers in float32, within a factor of 2 (these random K-quant models amplify last-bit differences up to
    # ~0.2 logit, and which of two summation orders lands closer is then chance: it differed between CPUs)
    with kernel_mode(invariant=True):
        got = paged_logits(ours, tokens).double()
    fp32_error = (ref[torch.float32] - ref[torch.float64]).abs()
    error = (got - ref[torch.float64]).abs()
    assert error.max().item() <= 2 * fp32_error.max().item() + 1e-4
    assert error.mean().item() <= 2 * fp32_error.mean().item() + 1e-6


def test_dequant_matches_gguf_package():
    """Our torch Q4_0/Q4_1/Q8_0 kernels vs the gguf package on random data, bit for bit."""
    from pagedllm.quantization.dequant import dequantize

    x = np.random.default_rng(2).standard_normal((64, 128)).astype(np.float32)
    for qt in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        raw = gguf.quants.quantize(x, qt)
        ref = gguf.quants.dequantize(raw, qt)
        got = dequantize(raw.reshape(-1), qt.name, (64, 128)).numpy()
        np.testing.assert_array_equal(got, ref)


def test_mxfp4_dequant_matches_gguf_package():
    """Our torch MXFP4 against the gguf package's numpy port of ggml's, bit for bit, over every scale byte but NaN's
    255 (2^(e - 128): subnormal below 2; from 253 the largest codes overflow to inf in both)."""
    from pagedllm.quantization.dequant import dequantize

    blocks = np.random.default_rng(fresh_seed()).integers(0, 256, (8 * 255, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(blocks.shape[0]) % 255
    with np.errstate(over="ignore"):
        ref = gguf.quants.dequantize(blocks.reshape(-1), Q.MXFP4)
    np.testing.assert_array_equal(dequantize(blocks.reshape(-1), "MXFP4", (8, 255 * 32)).numpy(), ref.reshape(8, -1))


def test_mxfp4_writer_quantizes_as_llama_cpp():
    """quantize_mxfp4 (the bench lab's writer) makes the blocks of ggml's quantize_row_mxfp4_ref, as the gguf
    package's port of it makes them: byte for byte, over block scales 2^-20..2^20, zeros and exact ties between two
    codes (which go to the smaller magnitude; -0.0 and tiny negatives to code 0)."""
    from pagedllm.testing.gguf_writer import quantize_mxfp4

    rng = np.random.default_rng(fresh_seed())
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    x *= np.exp2(rng.integers(-20, 21, (64, 32))).astype(np.float32).repeat(32, axis=1)
    x[0, :64] = np.arange(-32, 32) * 0.25  # scales 1 and 0.5: every midpoint between two codes is hit
    x[1, :32], x[1, 32:64] = 0.0, -0.0
    x[1, 64:96] = -1e-3 * np.arange(32)
    ref = gguf.quants.quantize(x, Q.MXFP4)
    np.testing.assert_array_equal(quantize_mxfp4(x), ref)
    np.testing.assert_array_equal(quantize_mxfp4(x.reshape(2, 32, 1024)), ref.reshape(2, 32, -1))


def test_directory_with_one_gguf(tmp_path):
    write_gguf(str(tmp_path / "m.gguf"), "qwen2", TYPE_SETS["q32"])
    loaded = load_model(str(tmp_path), attention_backend="reference", load_tokenizer=False)
    assert loaded.name == "m"  # the id clients use: the file name without .gguf (and any quant suffix)
    write_gguf(str(tmp_path / "n.gguf"), "qwen2", TYPE_SETS["q32"])
    with pytest.raises(ValueError, match="several"):
        load_model(str(tmp_path), load_tokenizer=False)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 definitely not gguf" * 10)
    with pytest.raises(InvalidModelError, match="not a GGUF"):
        load_model(str(p), load_tokenizer=False)


def test_truncated_gguf(tmp_path):
    p = tmp_path / "m.gguf"
    write_gguf(str(p), "llama", TYPE_SETS["q32"])
    data = p.read_bytes()
    for cut in (100, len(data) // 2):  # inside the metadata; inside the tensor data
        t = tmp_path / f"cut{cut}.gguf"
        t.write_bytes(data[:cut])
        with pytest.raises(InvalidModelError, match="truncated|corrupt"):
            load_model(str(t), load_tokenizer=False)
        assert gc.isenabled()  # the load pauses the cycle collector, and gives it back when it fails too


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(p), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="gpt2.*supported: llama"):
        load_model(str(p), load_tokenizer=False)


def test_unsupported_quant_type(tmp_path):
    p = tmp_path / "m.gguf"
    write_gguf(str(p), "llama", {**TYPE_SETS["q32"], "down": Q.Q8_1})
    with pytest.raises(UnsupportedModelError, match="Q8_1.*supported: F32"):
        load_model(str(p), load_tokenizer=False)


@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_mxfp4_nan_scale_is_refused_at_load(tmp_path, quantization):
    """An MXFP4 block whose e8m0 scale byte is 255 (NaN) fails the load with the tensor's name, whether its blocks
    would be packed for the kernels or dequantized: here the last block of a stacked expert tensor."""
    from pagedllm.model.gguf_reader import read_gguf
    from pagedllm.quantization.tensor import kernel_available
    from pagedllm.testing.gguf_writer import tiny_shape, write_random_gguf

    if quantization == "gguf" and not kernel_available():
        pytest.skip("the C++ kernels could not be built")
    path, name = str(tmp_path / "m.gguf"), "blk.1.ffn_down_exps.weight"
    shape = tiny_shape("qwen3moe", experts=4, experts_used=2, expert_ffn=128, qk_norm=True)
    write_random_gguf(path, shape, "MXFP4", tokenizer_from=None)
    f = read_gguf(path)
    info, blocks = f.tensors[name], f.tensors[name].nbytes // 17
    assert info.ggml_type == Q.MXFP4
    f.close()
    with open(path, "r+b") as fh:
        fh.seek(info.offset + 17 * (blocks - 1))
        fh.write(b"\xff")
    with pytest.raises(InvalidModelError, match=f"tensor '{name}'.*MXFP4 block {blocks - 1} of {blocks}: .*NaN"):
        load_model(path, attention_backend="reference", load_tokenizer=False, quantization=quantization)


def test_token_id_check(tmp_path):
    p = tmp_path / "m.gguf"
    write_gguf(str(p), "qwen2", TYPE_SETS["q32"])
    loaded = load_model(str(p), attention_backend="reference", load_tokenizer=False)
    loaded.check_token_ids([0, 5, V - 1])
    for bad in ([V], [-1], [3, 10**9]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            loaded.check_token_ids(bad)


def test_hf_llama3_converted_like_llama_cpp(tmp_path):
    """An HF Llama with llama3 rope scaling, written to GGUF the way llama.cpp's converter does (Q/K permuted,
    scaling as a rope_freqs tensor): our GGUF load gives the HF model's own logits."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=512, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, rope_parameters={
                          "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    torch.manual_seed(3)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(scaled, base)

    path = str(tmp_path / "llama3.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}
    for name, t in hf.state_dict().items():
        arr = t.numpy().astype(np.float32)
        if name in names:
            w.add_tensor(names[name], arr)
            continue
        i, rest = name.split(".")[2], ".".join(name.split(".")[3:])
        if rest.endswith("q_proj.weight"):
            arr = _permute(arr, 4)
        elif rest.endswith("k_proj.weight"):
            arr = _permute(arr, 2)
        w.add_tensor(f"blk.{i}.{layer[rest]}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours = load_model(path, "float32", attention_backend="reference", load_tokenizer=False, quantization="none")
    assert ours.config.rope_scaling["rope_type"] == "freq_factors"
    tokens = np.random.default_rng(4).integers(0, V, 40).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (paged_logits(ours, tokens) - ref).abs().max().item() < 1e-4


def test_gguf_model_name_drops_the_quantisation():
    from pagedllm.model.loader import gguf_model_name

    assert gguf_model_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert gguf_model_name("llama-3-8b.Q4_K_M.gguf") == "llama-3-8b"
    assert gguf_model_name("tiny-f16.gguf") == "tiny"
    assert gguf_model_name("plain.gguf") == "plain"
