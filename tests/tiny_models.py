"""Tiny random Llama-family checkpoints (saved as real HF directories) and a small real tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks. "
    "A block table maps logical blocks to physical blocks. Copy on write keeps shared prefixes intact. "
    "Héllo wörld, naïve café! 1234567890. Über straße. 日本語のテキスト. Emoji: 🙂🚀. "
) * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    # 4 local + 2 global layers, window 16: the hybrid KV layout makes 3 groups of 2 layers (1 full, 2 sliding)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "num_hidden_layers": 6, "sliding_window": 16, "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),  # every layer slides
}


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                          "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, tokenizer=None, **overrides) -> Path:
    """Save a random tiny model of `arch` with a real BPE tokenizer (make_tokenizer's unless given) into `path`;
    return it."""
    import transformers

    cfg_name, model_name, extra = ARCHS[arch]
    tokenizer = tokenizer if tokenizer is not None else make_tokenizer()
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  tie_word_embeddings=False, rms_norm_eps=1e-5)
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # larger-than-default weights make logits decisive (fewer greedy near-ties)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
