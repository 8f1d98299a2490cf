"""Tiny random Llama-family checkpoints (saved as real HF directories), a small real tokenizer, and the helpers
the engine tests share (make_llm and its defaults, seeded random prompts, fresh_seed, the leak check,
wait_until)."""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

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
    # windowed and full layers alternating (window 16), sinks, 4 experts of which 2 per token, YaRN
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 16, "sliding_window": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 256}}),
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


def make_llm(path, **kw):
    """An LLM over a tiny checkpoint with the engine tests' defaults: float32, the reference attention (the
    oracle), blocks of 8, a 256-block cache; keyword arguments override them."""
    from pagedllm import LLM

    kw.setdefault("dtype", "float32")
    kw.setdefault("attention_backend", "reference")
    kw.setdefault("block_size", 8)
    kw.setdefault("num_kv_blocks", 256)
    return LLM(str(path), **kw)


def fresh_seed() -> int:
    """A seed for a test's random inputs: $PAGEDLLM_TEST_SEED when set (to rerun a failure), else a fresh one.
    Printed: pytest shows a failing test's output, so the failure names the seed that reproduces it."""
    env = os.environ.get("PAGEDLLM_TEST_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(2), "little")
    print(f"random inputs: PAGEDLLM_TEST_SEED={seed}")
    return seed


def random_prompts(n: int, seed: int, lo: int = 3, hi: int = 60, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_no_leaks(llm) -> None:
    """After all requests finish every block is free (cached blocks are free-and-evictable)."""
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


T = TypeVar("T")


def wait_until(predicate: Callable[[], T], what: str | Callable[[], str], timeout: float = 60.0,
               interval: float = 0.02) -> T:
    """Poll `predicate` until it returns something truthy, and return that. The deadline only bounds the wait
    (generous: a loaded machine is slow), it never decides a test: a condition that never holds fails naming
    `what` (a callable: evaluated then, to show the state at the time)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout:g} s for {what() if callable(what) else what}; never held")
        time.sleep(interval)


def hf_model_from_gguf(path: str, dtype: torch.dtype):
    """transformers' model of a GGUF file with every weight dequantized at load: the reference arithmetic in
    `dtype`. Recent transformers keep the blocks packed wherever the `kernels` package offers a GGUF matmul, and
    those compute in float32 whatever the dtype; without one they dequantize anyway."""
    import transformers

    kwargs = {}
    if hasattr(transformers, "GgufConfig"):
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(_without_vocabulary_arrays(path, tmp))
        return transformers.AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=dtype,
                                                                 **kwargs).eval()


def _without_vocabulary_arrays(path: str, directory: str) -> str:
    """A copy of the GGUF file without its tokenizer arrays (tokens, scores, merges) for transformers' model
    loader, which parses every metadata entry twice in Python (a 262k vocabulary: most of a minute) and needs none
    of them but the vocabulary's size, added as `{arch}.vocab_size` where the file has no such entry. Tensors and
    every other entry are copied byte for byte."""
    import struct

    import numpy as np

    from pagedllm.model.gguf_reader import StringArray, read_gguf

    f = read_gguf(path)
    try:
        arch, meta = f.architecture, f.metadata
        keys = [k for k in f.kv_spans
                if not (k.startswith("tokenizer.") and isinstance(meta[k], list | np.ndarray | StringArray))]
        extra = b""
        if f"{arch}.vocab_size" not in meta and "tokenizer.ggml.tokens" in meta:
            key = f"{arch}.vocab_size".encode()
            extra = struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, len(meta["tokenizer.ggml.tokens"]))
        data_start = min(t.offset for t in f.tensors.values())
        infos = b"".join(struct.pack("<Q", len(t.name.encode())) + t.name.encode() + struct.pack("<I", len(t.shape))
                         + struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape))
                         + struct.pack("<IQ", t.ggml_type, t.offset - data_start) for t in f.tensors.values())
        head = b"GGUF" + struct.pack("<IQQ", f.version, len(f.tensors), len(keys) + bool(extra))
        head += b"".join(f.blob[slice(*f.kv_spans[k])].tobytes() for k in keys) + extra + infos
        align = meta.get("general.alignment", 32)
        out = os.path.join(directory, os.path.basename(path))
        with open(out, "wb") as fh:
            fh.write(head + bytes(-len(head) % align))
            fh.write(memoryview(f.blob[data_start:]))
    finally:
        f.close()
    return out


def add_sentence_transformers_files(path: Path, pooling: str | None = "lasttoken", normalize: bool = True) -> Path:
    """Make a saved checkpoint a sentence-transformers model: modules.json, 1_Pooling/config.json with
    `pooling_mode_{pooling}` (lasttoken, mean_tokens or cls_token; None: no Pooling module) and, when `normalize`,
    a 2_Normalize module."""
    import json

    path = Path(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    if pooling is None:
        return path
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    modes = {f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "max_tokens",
                                                          "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")}
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden, **modes}))
    return path
