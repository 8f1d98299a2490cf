"""Hugging Face directory loading: single and sharded safetensors, generation_config eos ids, tokenizer with its
chat template, and errors that say what is wrong."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.attention import build_attention_metadata
from pagedllm.model import UnsupportedModelError, allocate_kv_caches, load_model


def _tiny_qwen2(tmp_path, shard: str | None = None):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=128,
                      tie_word_embeddings=False, eos_token_id=3)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    kwargs = {"max_shard_size": shard} if shard else {}
    hf.save_pretrained(str(tmp_path), **kwargs)
    return hf


def _logits(loaded, tokens):
    kv = allocate_kv_caches(loaded.config, 4, torch.float32, num_blocks=16)
    n = len(tokens)
    meta = build_attention_metadata([[9, 3, 12, 0, 5][: -(-n // 4)]], [0], [n], 4)
    return loaded.model.compute_logits(loaded.model(torch.tensor(tokens), torch.arange(n), kv, meta))


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_single_and_sharded_safetensors(tmp_path, shard):
    hf = _tiny_qwen2(tmp_path, shard)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert (len(files) > 1) == (shard is not None)
    loaded = load_model(str(tmp_path), "float32", attention_backend="reference", load_tokenizer=False)
    assert loaded.config.architecture == "qwen2" and loaded.config.qkv_bias
    assert loaded.eos_token_ids == [3]
    tokens = [5, 9, 1, 33, 60, 2, 2, 17, 40]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (_logits(loaded, tokens) - ref).abs().max().item() < 1e-4


def test_generation_config_eos_ids_win(tmp_path):
    _tiny_qwen2(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    loaded = load_model(str(tmp_path), attention_backend="reference", load_tokenizer=False)
    assert loaded.eos_token_ids == [3, 7]


def test_tokenizer_and_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _tiny_qwen2(tmp_path)
    words = ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", ":", "\n"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(str(tmp_path))
    loaded = load_model(str(tmp_path), attention_backend="reference")
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}], tokenize=False)
    assert text == "user: hello world\n"
    assert loaded.tokenizer.convert_tokens_to_ids(["hello", "world"]) == [3, 4]
    assert loaded.tokenizer.eos_token == "</s>"
    assert loaded.name == os.path.basename(str(tmp_path))


def test_no_tokenizer_files_is_not_fatal(tmp_path):
    """The model loads, and token-id prompts generate token ids (with logprobs; no text); stop strings, which need
    text, are refused naming the way out."""
    from pagedllm import LLM, SamplingParams

    _tiny_qwen2(tmp_path)
    assert load_model(str(tmp_path), attention_backend="reference").tokenizer is None
    llm = LLM(str(tmp_path), attention_backend="reference", dtype="float32", num_kv_blocks=32)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].text == ""
    assert len(out[0].outputs[0].logprobs) == 5
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, stop=["x"]), use_tqdm=False)


def test_bfloat16_weights(tmp_path):
    _tiny_qwen2(tmp_path)
    loaded = load_model(str(tmp_path), "bfloat16", attention_backend="reference", load_tokenizer=False)
    assert loaded.model.layers[0].attn.qkv.weight.dtype == torch.bfloat16
    assert _logits(loaded, [1, 2, 3]).dtype == torch.float32


def test_missing_path_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(str(tmp_path))


def test_missing_weights_files_and_tensors(tmp_path):
    _tiny_qwen2(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 1 weight.*up_proj"):
        load_model(str(tmp_path), load_tokenizer=False)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="shape"):
        load_model(str(tmp_path), load_tokenizer=False)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path), load_tokenizer=False)


def test_missing_shard(tmp_path):
    _tiny_qwen2(tmp_path, "20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    (tmp_path / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_model(str(tmp_path), load_tokenizer=False)
