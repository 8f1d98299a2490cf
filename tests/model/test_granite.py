"""Granite (GraniteForCausalLM, GGUF `granite`): a Llama layer with four multipliers (embeddings, each residual
branch, the attention scale, the logits). The HF-directory path runs every paged-batch test of test_model_hf; here
the GGUF file, written by our writer and by llama.cpp's converter where `make bench-setup` built it, against
transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_to_gguf import llama_cpp_convert, paged_logits, random_hf_model, write_hf_as_gguf

from pagedllm.model import load_model


def _granite(vocab: int = 128) -> torch.nn.Module:
    import transformers as tf

    cfg = tf.GraniteConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, embedding_multiplier=3.0, residual_multiplier=0.5,
                           attention_multiplier=0.2, logits_scaling=2.5)
    return random_hf_model(cfg)


def _check(path: str, hf: torch.nn.Module, vocab: int) -> None:
    ours = load_model(path, "float32", attention_backend="reference", load_tokenizer=False, quantization="none")
    cfg = ours.config
    assert (cfg.architecture, cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == \
        ("granite", 3.0, 0.5, 2.5)
    assert cfg.attention_multiplier == pytest.approx(0.2)
    tokens = np.random.default_rng(2).integers(0, vocab, 29).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert ref.abs().max() > 1.0
    assert (paged_logits(ours, tokens) - ref).abs().max().item() < 1e-4


def test_granite_gguf_matches_transformers(tmp_path):
    hf = _granite()
    path = str(tmp_path / "granite.gguf")
    write_hf_as_gguf(hf, "granite", path)
    _check(path, hf, 128)


def test_llama_cpp_converted_granite_matches_transformers(tmp_path):
    out, hf, vocab = llama_cpp_convert(_granite, tmp_path)
    _check(out, hf, vocab)
