"""The real SmolLM2-135M-Instruct GGUF through the whole engine, against transformers on the same file."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.",
             "Write one sentence about the sea.", "What is 12 plus 7?", "Say hello in Spanish."]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", attention_backend="reference", num_kv_blocks=512, quantization="none")


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):
    return hf_smollm2


def test_batched_chat_greedy_matches_transformers(llm, hf_model):
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:3]]  # each costs transformers a generate
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for out in outs:
        prompt = out.prompt_token_ids
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    print("\nSmolLM2:", QUESTIONS[0], "->", outs[0].outputs[0].text)
    assert "Paris" in outs[0].outputs[0].text
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["prefix_cache_hits"] > 0  # the chat template's shared system prompt


def test_speculative_decoding_greedy_equals_plain_on_the_real_model(llm):
    """n-gram prompt lookup and the model as its own draft: the same greedy tokens as plain decoding, batched and
    alone, on an input-grounded prompt (the answer quotes the prompt) and open-ended questions."""
    quote = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill."
    convs = [[{"role": "user", "content": f"Repeat this sentence exactly: {quote}"}]] + \
        [[{"role": "user", "content": q}] for q in QUESTIONS[2:4]]
    params = SamplingParams(temperature=0, max_tokens=24)
    reference = [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "draft_model", "model": llm.engine.args.model or _default_model(),
                  "num_speculative_tokens": 3}):
        fast = LLM(dtype="float32", attention_backend="reference", num_kv_blocks=512, quantization="none",
                   speculative_config=spec)
        assert [o.outputs[0].token_ids for o in fast.chat(convs, params, use_tqdm=False)] == reference
        assert fast.chat(convs[0], params, use_tqdm=False)[0].outputs[0].token_ids == reference[0]
        stats = fast.engine.spec_decode_stats()
        assert stats["num_accepted_tokens"] > 0, stats
        kv = fast.kv_cache_stats()
        assert kv["num_free_blocks"] == kv["num_blocks"]


def _default_model() -> str:
    from pagedllm.model.loader import default_model_path

    return default_model_path()
