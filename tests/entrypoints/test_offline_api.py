"""The offline API's vLLM conveniences: dict prompts, RequestOutput.metrics, the sampling extras, the progress
bar's token rates."""

from __future__ import annotations

import pytest
from tiny_models import make_llm, make_tiny_model

from pagedllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return make_llm(make_tiny_model(tmp_path_factory.mktemp("tiny")), num_kv_blocks=64)


def test_dict_prompts_equal_plain_prompts(llm):
    ids = llm.engine.tokenize("The quick brown fox")
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain = llm.generate(["The quick brown fox", ids], greedy, use_tqdm=False)
    dicts = llm.generate([{"prompt": "The quick brown fox"}, {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[1].prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        plain[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([{"text": "x"}], greedy, use_tqdm=False)


def test_request_metrics_are_ordered(llm):
    (out,) = llm.generate(["Copy on write"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time == m.finished_time
    assert m.time_in_queue >= 0


def test_sampling_extras_offline(llm):
    tok = llm.get_tokenizer()
    (q,) = tok.encode("q", add_special_tokens=False)
    (out,) = llm.generate(["The fox"], SamplingParams(temperature=0, max_tokens=4, logit_bias={q: 100}),
                          use_tqdm=False)
    assert out.outputs[0].text == "qqqq"
    (out,) = llm.generate(["The fox"], SamplingParams(temperature=0, max_tokens=4, logit_bias={q: 100},
                                                      bad_words=["q"]), use_tqdm=False)
    assert "q" not in out.outputs[0].text
    (out,) = llm.generate(["The quick brown fox jumps"], SamplingParams(max_tokens=1, truncate_prompt_tokens=2),
                          use_tqdm=False)
    assert out.prompt_token_ids == llm.engine.tokenize("The quick brown fox jumps")[-2:]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    assert llm.kv_cache_stats()["num_free_blocks"] == llm.kv_cache_stats()["num_blocks"]


def test_progress_bar_shows_token_rates(llm, capsys):
    llm.generate(["a b c", "d e f"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=True)
    err = capsys.readouterr().err
    assert "est. speed input:" in err and "toks/s" in err and "output:" in err


def test_prompt_logprobs_equal_transformers(tmp_path):
    """Every prompt token's log-probability equals transformers' on the same weights, also when the prompt is
    prefilled in chunks and when the same prompt sits in the prefix cache already."""
    import torch
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "m")
    llm = make_llm(path, max_num_batched_tokens=16, num_kv_blocks=64)
    prompt = "Paged attention stores keys and values in blocks. A block table maps them."
    ids = llm.engine.tokenize(prompt)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    expected = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    for _ in range(2):  # the second run's prompt is in the prefix cache: it must be computed anyway
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)
        plp = out.prompt_logprobs
        assert plp[0] is None and len(plp) == len(ids) > 16
        got = torch.tensor([plp[p][ids[p]].logprob for p in range(1, len(ids))])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        top = ref[4].topk(3)
        assert {t: plp[5][t].rank for t in top.indices.tolist()} == {t: r for r, t in
                                                                      enumerate(top.indices.tolist(), 1)}
    assert llm.kv_cache_stats()["num_free_blocks"] == 64


def test_generation_config_defaults_and_hub_id_from_cache(tmp_path, monkeypatch):
    import json
    import shutil

    import huggingface_hub.constants

    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    path = make_tiny_model(tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 7, "max_new_tokens": 3}))
    repo = tmp_path / "hub" / "models--acme--tiny"
    shutil.copytree(path, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    llm = make_llm("acme/tiny", num_kv_blocks=32)  # a hub id, found in the (offline) cache
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 7, 3)
    (out,) = llm.generate(["The fox"], use_tqdm=False)
    (greedy,) = llm.generate(["The fox"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids and len(out.outputs[0].token_ids) <= 3
    assert make_llm("acme/tiny", num_kv_blocks=32, generation_config="vllm").engine.generation_defaults == {}
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        make_llm("acme/not-there")
    # the server: fields a request leaves out take the model's defaults; given ones win
    p = CompletionRequest(prompt="x").to_sampling_params(llm.engine.generation_defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 7, 16)  # completions' max_tokens defaults to 16
    p = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0.5).to_sampling_params(
        llm.engine.generation_defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.5, 7, 3)
