"""Phi-3 / Phi-4-mini (Phi3ForCausalLM, GGUF `phi3`) and SmolLM3 (SmolLM3ForCausalLM, GGUF `smollm3`): what makes
them differ from the Llama layer, against transformers. test_model_hf runs every paged-batch test on both; here
LongRoPE's switch from the short to the long factors, the files llama.cpp's converter writes (fused q|k|v and
gate|up, rope_factors_*, NoPE layers), the experts-free as-stored path over fused tensors, and the refusals."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from hf_to_gguf import llama_cpp_convert, paged_logits, random_hf_model

from pagedllm.model import load_model
from pagedllm.model.errors import InvalidModelError, UnsupportedModelError

SWITCH = 32  # LongRoPE's original context in these tests: sequences longer than this take the long factors


def _phi3(vocab: int = 128, **overrides) -> torch.nn.Module:
    """Phi-4-mini's switches in a tiny model: head 24 with 18 rotated dims, LongRoPE switching at SWITCH with a
    non-trivial attention factor, GQA, untied head."""
    import transformers as tf

    pairs = 9
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": SWITCH, "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
            "long_factor": [2.0 + 0.3 * i for i in range(pairs)]}
    cfg = tf.Phi3Config(hidden_size=96, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512,
                        original_max_position_embeddings=SWITCH, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        rope_parameters=rope, pad_token_id=0, bos_token_id=1, eos_token_id=2, **overrides)
    return random_hf_model(cfg)


def _smollm3(vocab: int = 128) -> torch.nn.Module:
    """SmolLM3's default layout: every 4th layer without RoPE."""
    import transformers as tf

    cfg = tf.SmolLM3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return random_hf_model(cfg)


def _hf_steps(hf: torch.nn.Module, tokens: list[int], steps: list[int]) -> torch.Tensor:
    """transformers' logits computed in these steps over its own cache (each step's LongRoPE factors chosen by
    the length so far, as its generate() does)."""
    out, past, done = [], None, 0
    with torch.no_grad():
        for n in steps:
            res = hf(torch.tensor([tokens[done:done + n]]), past_key_values=past, use_cache=True)
            out.append(res.logits[0])
            past, done = res.past_key_values, done + n
    return torch.cat(out)


def _load(path: str, **kw):
    return load_model(path, "float32", attention_backend="reference", load_tokenizer=False,
                      **{"quantization": "none", **kw})


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    hf = _phi3()
    path = str(tmp_path_factory.mktemp("phi3"))
    hf.save_pretrained(path)
    return hf, _load(path)


@pytest.mark.parametrize("steps", [[SWITCH], [SWITCH + 1], [SWITCH - 3, 1, 1, 1, 1, 1, 1], [SWITCH + 10]],
                         ids=["prefill-at-switch", "prefill-past-switch", "decode-across-switch", "long-prefill"])
def test_longrope_switches_where_transformers_does(phi3, steps):
    """A sequence of SWITCH tokens uses the short factors and one of SWITCH + 1 the long ones, in a prefill and
    in the decode step that crosses it (the cached keys keep the factors they were computed with, as in
    transformers' cache); the two factor sets give visibly different logits."""
    hf, ours = phi3
    tokens = np.random.default_rng(sum(steps) + len(steps)).integers(0, 128, sum(steps)).tolist()
    ref = _hf_steps(hf, tokens, steps)
    assert (paged_logits(ours, tokens, steps) - ref).abs().max().item() < 1e-4
    if sum(steps) > SWITCH:  # the long factors matter: the short ones alone would be far off
        rotary = ours.model.rotary
        rotary.switch, switch = None, rotary.switch
        try:
            short_only = paged_logits(ours, tokens, steps)
        finally:
            rotary.switch = switch
        assert (short_only[-1] - ref[-1]).abs().max().item() > 1e-2


def test_longrope_attention_factor_from_the_context_extension(phi3):
    _, ours = phi3
    scaling = ours.config.rope_scaling
    assert scaling["original_max_position_embeddings"] == SWITCH
    assert scaling["attention_factor"] == pytest.approx((1 + np.log(512 / SWITCH) / np.log(SWITCH)) ** 0.5)
    assert ours.config.rotary_dim == 18


def test_rotary_row_order_keeps_q_dot_k():
    """The stored q/k layout of partial rotary: under RotaryEmbedding's tables, q.k after RoPE is what HF's rotate
    the first r dims, pass the rest gives, for random q, k and positions."""
    from pagedllm.model.layers import RotaryEmbedding, apply_rope, rope_inv_freq, rotary_row_order

    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    for head_dim, rot in ((24, 18), (128, 96), (64, 64), (16, 2)):
        q, k = torch.randn(5, 1, head_dim, generator=gen), torch.randn(5, 1, head_dim, generator=gen)
        pos_q, pos_k = torch.randint(0, 3000, (5,), generator=gen), torch.randint(0, 3000, (5,), generator=gen)

        def hf_rope(x, pos, rot=rot):
            freqs = pos[:, None].float() * rope_inv_freq(rot, 1e4, None)[None, :]
            emb = torch.cat((freqs, freqs), -1)[:, None, :]
            return torch.cat((apply_rope(x[..., :rot], emb.cos(), emb.sin()), x[..., rot:]), -1)

        order = rotary_row_order(head_dim, rot)
        assert sorted(order.tolist()) == list(range(head_dim))
        rotary = RotaryEmbedding(head_dim, 1e4, None, rot)
        ours_q = apply_rope(q[..., order], *rotary(pos_q, torch.float32))
        ours_k = apply_rope(k[..., order], *rotary(pos_k, torch.float32))
        want = (hf_rope(q, pos_q) * hf_rope(k, pos_k)).sum(-1)
        assert torch.allclose((ours_q * ours_k).sum(-1), want, atol=1e-5), seed


@pytest.fixture(scope="module")
def converted_phi3(tmp_path_factory):
    """llama.cpp's converter's file (Phi-4-mini's GPT2-style tokenizer takes its BPE path: no SentencePiece model
    needed), the transformers model, its vocabulary size."""
    return llama_cpp_convert(_phi3, tmp_path_factory.mktemp("converted"), tokenizer_class="GPT2Tokenizer")


def test_llama_cpp_converted_phi3_matches_transformers(converted_phi3):
    """llama.cpp's converter writes attn_qkv, a gate|up ffn_up, rope.dimension_count and rope_factors_short/long."""
    out, hf, vocab = converted_phi3
    ours = _load(out)
    cfg = ours.config
    assert (cfg.architecture, cfg.rotary_dim, cfg.rope_scaling["rope_type"]) == ("phi3", 18, "longrope")
    for n in (SWITCH, SWITCH + 7):  # both factor sets
        tokens = np.random.default_rng(n).integers(0, vocab, n).tolist()
        assert (paged_logits(ours, tokens) - _hf_steps(hf, tokens, [n])).abs().max().item() < 1e-4


def test_phi3_fused_tensors_run_as_stored(tmp_path):
    """A Q8_0 file (llama.cpp's converter): the fused q|k|v and gate|up blocks split into their shards, the q/k
    rows reordered for partial rotary, in the quantized kernel's packed form; against the same file dequantized."""
    q8, _, vocab = llama_cpp_convert(_phi3, tmp_path, tokenizer_class="GPT2Tokenizer", outtype="q8_0")
    stored = _load(q8, quantization="gguf")
    assert type(stored.model.layers[0].attn.qkv.segments[0]).__name__ == "QuantTensor"
    want = _load(q8)
    tokens = np.random.default_rng(3).integers(0, vocab, 40).tolist()
    got, ref = paged_logits(stored, tokens), paged_logits(want, tokens)
    # Q8_0 activations against float ones: close; a wrong row order or shard split would be off by O(logits)
    assert (got - ref).abs().max().item() < 0.1 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.8


def test_smollm3_nope_layers(tmp_path):
    """Every 4th layer without RoPE, from config.json and from llama.cpp's converter (which stores no interval:
    llama.cpp's graph fixes it at 4)."""
    hf = _smollm3()
    hf.save_pretrained(tmp_path / "hf_dir")
    tokens = np.random.default_rng(5).integers(0, 128, 37).tolist()
    ref = _hf_steps(hf, tokens, [37])
    ours = _load(str(tmp_path / "hf_dir"))
    assert ours.config.nope_layers == [3]
    assert (paged_logits(ours, tokens) - ref).abs().max().item() < 1e-4
    out, hf, vocab = llama_cpp_convert(_smollm3, tmp_path / "converted")
    converted = _load(out)
    assert (converted.config.architecture, converted.config.nope_layers) == ("smollm3", [3])
    tokens = np.random.default_rng(6).integers(0, vocab, 37).tolist()
    assert (paged_logits(converted, tokens, [30] + [1] * 7) - _hf_steps(hf, tokens, [37])).abs().max() < 1e-4


def _config_dir(tmp_path, **changes) -> str:
    hf = _phi3()
    hf.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is None:
            cfg["rope_parameters"].pop(key)
        else:
            cfg["rope_parameters"][key] = value
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(tmp_path)


@pytest.mark.parametrize("changes,error,field", [
    ({"rope_type": "dynamic-ntk-by-parts"}, UnsupportedModelError, "rope_scaling.rope_type"),
    ({"long_factor": None}, InvalidModelError, "rope_scaling.long_factor"),
    ({"short_factor": [1.0, 2.0]}, InvalidModelError, "rope_scaling.short_factor"),
    ({"long_factor": [1.0] * 8 + [float("nan")]}, InvalidModelError, "rope_scaling.long_factor"),
    ({"partial_rotary_factor": 0.625}, InvalidModelError, "partial_rotary_factor"),
])
def test_bad_rope_settings_are_refused_naming_the_field(tmp_path, changes, error, field):
    with pytest.raises(error, match=field.replace(".", r"\.")) as raised:
        _load(_config_dir(tmp_path, **changes))
    assert os.path.basename(str(tmp_path)) in str(raised.value) or raised.value.field == field


def test_gguf_longrope_without_its_long_factors_is_refused(tmp_path, converted_phi3):
    import gguf

    out, _, _ = converted_phi3
    reader = gguf.GGUFReader(out)
    broken = str(tmp_path / "no-long-factors.gguf")
    writer = gguf.GGUFWriter(broken, "phi3")
    for name, field in reader.fields.items():
        if name.startswith("phi3.") or name.startswith("tokenizer."):
            writer.add_key_value(name, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name != "rope_factors_long.weight":
            writer.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidModelError, match="rope_factors_long"):
        _load(broken)
