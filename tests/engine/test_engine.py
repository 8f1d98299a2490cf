"""The engine end to end on tiny random models: exact against transformers, robust to preemption, no leaks."""

from __future__ import annotations

import pytest
import torch
from tiny_models import assert_no_leaks, make_llm, make_tiny_model, random_prompts, tokens

from pagedllm import BeamSearchParams, SamplingParams
from pagedllm.engine.request_stream import RequestFailedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_mixed_batch(tiny_dir, hf_model):
    prompts = random_prompts(6, seed=1)
    llm = make_llm(tiny_dir)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, GREEDY.max_tokens)
        assert out.prompt_token_ids == prompt
    assert_no_leaks(llm)


def test_text_prompt_and_detokenisation(tiny_dir):
    llm = make_llm(tiny_dir)
    out = llm.generate("Héllo wörld 🙂, paged attention", SamplingParams(temperature=0, max_tokens=16,
                                                                           ignore_eos=True), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert out.prompt_token_ids == tok.encode("Héllo wörld 🙂, paged attention")


def test_preemption_gives_identical_outputs(tiny_dir):
    prompts = random_prompts(8, seed=2, lo=20, hi=40)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = tokens(make_llm(tiny_dir).generate(prompts, params, use_tqdm=False))
    small = make_llm(tiny_dir, num_kv_blocks=24, max_num_batched_tokens=64)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == reference
    assert small.kv_cache_stats()["num_preemptions"] > 0
    assert_no_leaks(small)


@pytest.mark.parametrize("chunked,prefix", [(False, True), (True, False), (False, False)])
def test_chunked_prefill_and_prefix_caching_do_not_change_outputs(tiny_dir, chunked, prefix):
    shared = random_prompts(1, seed=5, lo=40, hi=40)[0]
    prompts = [shared + p for p in random_prompts(6, seed=6, lo=1, hi=30)]
    reference = tokens(make_llm(tiny_dir, max_num_batched_tokens=32).generate(prompts, GREEDY, use_tqdm=False))
    llm = make_llm(tiny_dir, enable_chunked_prefill=chunked, enable_prefix_caching=prefix,
                   max_num_batched_tokens=32 if chunked else 2048)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    stats = llm.kv_cache_stats()
    assert (stats["prefix_cache_hits"] > 0) == prefix
    assert_no_leaks(llm)


def test_prefix_hits_reported_per_request(tiny_dir):
    llm = make_llm(tiny_dir)
    prompt = random_prompts(1, seed=7, lo=50, hi=50)[0]
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48  # 6 full blocks of 8; the last token is always recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_parallel_sampling_forks_and_is_reproducible(tiny_dir):
    prompt = random_prompts(1, seed=8, lo=61, hi=61)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    llm = make_llm(tiny_dir)
    a = llm.generate([prompt], params, use_tqdm=False)[0]
    peak_n4 = llm.kv_cache_stats()["peak_used_blocks"]
    assert [c.index for c in a.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # samples differ
    # same seed, other requests in the batch: same tokens
    others = random_prompts(3, seed=9)
    b = make_llm(tiny_dir).generate([prompt] + others, [params] + [GREEDY] * 3, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    single = make_llm(tiny_dir)
    single.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True),
                    use_tqdm=False)
    peak_one = single.kv_cache_stats()["peak_used_blocks"]
    assert peak_n4 < 2 * peak_one  # the 8 prompt blocks are shared, only tails are per sample
    assert_no_leaks(llm)


def test_stop_strings_and_stop_tokens(tiny_dir):
    llm = make_llm(tiny_dir)
    prompt = random_prompts(1, seed=10)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    # a stop string taken from the middle of the free-running text, possibly across token boundaries
    text = free.text
    assert len(text) > 6
    stop = text[len(text) // 2: len(text) // 2 + 3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    stop_tok = free.token_ids[5]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                                stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    first = free.token_ids.index(stop_tok)
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == free.token_ids[:7]
    assert_no_leaks(llm)


def test_abort_frees_blocks_and_others_go_on(tiny_dir):
    llm = make_llm(tiny_dir)
    engine = llm.engine
    prompts = random_prompts(3, seed=11, lo=30, hi=30)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    engine.step()
    engine.step()
    used_before = engine.kv.num_free_blocks()
    engine.abort_request("r1")
    assert engine.kv.num_free_blocks() > used_before
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert set(done) == {"r0", "r2"}
    expected = tokens(make_llm(tiny_dir).generate([prompts[0], prompts[2]], params, use_tqdm=False))
    assert [done["r0"], done["r2"]] == expected
    assert_no_leaks(llm)


@pytest.mark.parametrize("kwargs,name", [
    ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.5}, "temperature"), ({"top_k": -3}, "top_k"), ({"min_p": 2.0}, "min_p"),
])
def test_bad_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_and_engine_keeps_serving(tiny_dir):
    llm = make_llm(tiny_dir, max_model_len=128)
    engine = llm.engine
    engine.add_request("good", random_prompts(1, seed=12)[0], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty-text", "", GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [5] * 200, GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", [5, 10**6], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", [5, 6], GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["good"]
    assert_no_leaks(llm)


def test_prompt_larger_than_the_pool_is_rejected(tiny_dir):
    llm = make_llm(tiny_dir, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([[5] * 40], GREEDY, use_tqdm=False)
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def eos_dir(tmp_path_factory):
    """Same weights, but EOS is a token this model often ranks high: beams finish at different lengths."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_eos"), "llama", seed=3, eos_token_id=157)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
def test_beam_search_matches_transformers(eos_dir, length_penalty):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(eos_dir, dtype=torch.float32).eval()
    prompts = random_prompts(6, seed=21, lo=5, hi=20)
    params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=length_penalty)
    llm = make_llm(eos_dir)
    outs = llm.beam_search(prompts, params)
    ended_early = 0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), num_beams=4, do_sample=False, max_new_tokens=12,
                              length_penalty=length_penalty,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected = ref[0, len(prompt):].tolist()
        if 157 in expected:  # HF pads a finished beam after its EOS
            expected = expected[: expected.index(157) + 1]
            ended_early += len(expected) < 12
        assert out.sequences[0].tokens == expected
        assert len(out.sequences) == 4 and out.sequences[0].score >= out.sequences[-1].score
    if length_penalty <= 1.0:  # (a large penalty favours long beams: none may end early)
        assert ended_early > 0  # the EOS path was exercised
    assert_no_leaks(llm)


def test_beam_search_shares_blocks(tiny_dir):
    prompt = random_prompts(1, seed=14, lo=64, hi=64)[0]
    llm = make_llm(tiny_dir)
    llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True))
    peak = llm.kv_cache_stats()["peak_used_blocks"]
    unshared = 4 * -(-(64 + 16) // 8)
    assert peak <= 0.5 * unshared
    assert_no_leaks(llm)


def test_logprobs_match_transformers(tiny_dir, hf_model):
    prompt = random_prompts(1, seed=15)[0]
    llm = make_llm(tiny_dir)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    seq = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        ref = hf_model(seq).logits[0, len(prompt) - 1: -1].log_softmax(-1)
    assert len(out.logprobs) == 8
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert entry[tok].rank == 1
        assert abs(entry[tok].logprob - ref[step, tok].item()) < 1e-4
        top = ref[step].topk(3)
        assert set(entry) == set(top.indices.tolist())
    assert abs(out.cumulative_logprob - sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs,
                                                                         strict=True))) < 1e-4


def test_repetition_penalty_matches_transformers(tiny_dir, hf_model):
    prompt = random_prompts(1, seed=16)[0]
    llm = make_llm(tiny_dir)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5),
                       use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                repetition_penalty=1.5, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert out.token_ids == ref[0, len(prompt):].tolist()


def test_mean_slot_utilisation_is_sampled_while_running(tiny_dir):
    llm = make_llm(tiny_dir, enable_prefix_caching=False)
    llm.generate(random_prompts(4, seed=17, lo=20, hi=40), GREEDY, use_tqdm=False)
    util = llm.kv_cache_stats()["mean_slot_utilisation"]
    assert 0.5 < util <= 1.0  # block size 8: at most 7 empty slots per request's last block


def test_request_that_can_never_fit_the_cache_is_rejected_not_stalled(tiny_dir):
    llm = make_llm(tiny_dir, num_kv_blocks=8)  # 64 slots
    prompt = random_prompts(1, seed=20, lo=10, hi=10)[0]
    with pytest.raises(ValueError, match=r"max_tokens \(100\) needs 109 KV slots but the whole cache holds 64"):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    # open-ended: runs to the cache's capacity and finishes with "length"; the queue behind it moves on
    outs = llm.generate([prompt, prompt[:4]], [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                                               SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 64 + 1 - 10 and outs[0].outputs[0].finish_reason == "length"
    assert len(outs[1].outputs[0].token_ids) <= 4
    assert_no_leaks(llm)


def test_a_failing_model_step_fails_only_the_request_that_causes_it(tiny_dir):
    prompts = random_prompts(5, seed=21)
    poison = prompts[2] + [2]  # token 2 never occurs in random_prompts: the injected fault
    reference = tokens(make_llm(tiny_dir).generate(prompts, GREEDY, use_tqdm=False))
    llm = make_llm(tiny_dir)
    execute = llm.engine.runner.execute

    def faulty(scheduled, *args):
        if any(2 in s.request.all_token_ids for s in scheduled):
            raise RuntimeError("injected fault")
        return execute(scheduled, *args)

    llm.engine.runner.execute = faulty
    with pytest.raises(RequestFailedError, match="1 of 5 requests failed in the engine; prompt 2: .*injected fault") \
            as excinfo:
        llm.generate(prompts[:2] + [poison] + prompts[3:], GREEDY, use_tqdm=False)  # never an empty text
    outs = excinfo.value.outputs
    assert "injected fault" in outs[2].error and outs[2].outputs[0].finish_reason == "abort"
    assert [o.error for i, o in enumerate(outs) if i != 2] == [None] * 4
    assert [t for i, t in enumerate(tokens(outs)) if i != 2] == reference[:2] + reference[3:]
    assert_no_leaks(llm)
