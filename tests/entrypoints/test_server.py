"""The OpenAI-compatible server, end to end: the real `openai` client against a live uvicorn server on
127.0.0.1 serving the real default model; greedy results checked against LLM.generate / LLM.chat."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import pytest

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from live_server import API_KEY, LiveServer, wait_idle  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tiny_models import fresh_seed, wait_until  # noqa: E402

from pagedllm import SamplingParams  # noqa: E402
from pagedllm.engine.async_engine import AsyncEngine  # noqa: E402
from pagedllm.entrypoints.openai.server import build_app  # noqa: E402

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
NUM_BLOCKS = 320
BLOCK = 16
WORDS = ("river apple orange cloud silver garden window music yellow market bridge winter forest number "
         "little paper story engine planet doctor summer castle rabbit pencil").split()


def random_prompt(rng: random.Random, n_words: int) -> str:
    return "Write about " + " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


@pytest.fixture(scope="module")
def llm():
    from pagedllm import LLM

    return LLM(dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=MAX_MODEL_LEN, seed=0)


@pytest.fixture(scope="module")
def seed() -> int:
    """Fresh inputs every run ($PAGEDLLM_TEST_SEED to rerun one)."""
    return fresh_seed()


@pytest.fixture(autouse=True)
def _print_seed(seed: int) -> None:
    # a module fixture's print shows only in its first test's report: repeat the seed in every test's
    print(f"random inputs: PAGEDLLM_TEST_SEED={seed}")


@pytest.fixture(scope="module")
def prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [random_prompt(rng, rng.randint(3, 8)) for _ in range(64)]


@pytest.fixture(scope="module")
def async_engine(llm):
    engine = AsyncEngine(llm.engine)
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def oracle(llm, async_engine, prompts):
    """Greedy outputs of the offline API (LLM.generate), run in the engine's loop thread (the engine is only
    ever used from one thread) before the server takes requests."""
    outs = asyncio.run(async_engine.call(
        lambda _: llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def server(async_engine, oracle):
    app = build_app(async_engine, api_key=API_KEY, served_model_name="smol")
    with LiveServer(app) as live:
        live.engine = async_engine
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def assert_no_leak(stats: dict) -> None:
    assert stats["num_free_blocks"] == stats["num_blocks"], stats  # every block free (possibly cached)
    assert stats["num_requests"] == 0, stats


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


# --- happy paths -------------------------------------------------------------------------------------------
def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["smol"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_completions_greedy_equal_llm_generate(client, prompts, oracle):
    resp = client.completions.create(model="smol", prompt=prompts[:3], max_tokens=12, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == oracle[:3]
    assert resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_completions_stream_equals_non_stream(client, prompts, oracle):
    stream = client.completions.create(model="smol", prompt=prompts[3], max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == oracle[3]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1


def test_multi_prompt_stream_and_echo(client, prompts, oracle):
    stream = client.completions.create(model="smol", prompt=prompts[11:13], max_tokens=12, temperature=0,
                                       stream=True)
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for ch in stream:
        c = ch.choices[0]
        texts[c.index] += c.text
        if c.finish_reason:
            finishes[c.index].append(c.finish_reason)
    assert [texts[0], texts[1]] == oracle[11:13]
    assert all(len(f) == 1 for f in finishes.values())
    resp = client.completions.create(model="smol", prompt=prompts[11], max_tokens=12, temperature=0, echo=True)
    assert resp.choices[0].text == prompts[11] + oracle[11]


def test_sse_wire_format(server, prompts):
    body = {"model": "smol", "prompt": prompts[4], "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: ")
        d = json.loads(ev[len("data: "):])
        assert d["object"] == "text_completion" and d["id"].startswith("cmpl-") and "usage" not in d


def test_chat_greedy_equal_llm_chat_and_stream(server, llm, client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": f"Name a colour and the number {random.randint(1, 99)}."}]
    resp = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0)
    text = resp.choices[0].message.content
    assert resp.choices[0].message.role == "assistant" and resp.id.startswith("chatcmpl-")
    stream = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # LLM.chat on the same engine, run in the loop thread while no request is in flight
    wait_idle(server)
    expected = asyncio.run(server.engine.call(lambda e: llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]))
    assert text == expected.outputs[0].text
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_n2_seed_reproducible(client, prompts):
    # The first request of each pair is a cold prefill (a prompt no other test sends), the second hits the prefix
    # cache: with the batch-invariant kernels both compute every row the same way.
    kw = dict(model="smol", prompt=prompts[5] + " (seeded twice)", max_tokens=10, temperature=1.0, n=2, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    chat_kw = dict(model="smol", messages=[{"role": "user", "content": prompts[5] + " (chat, seeded)"}],
                   max_tokens=8, n=2, seed=7, temperature=1.0)
    chat = client.chat.completions.create(**chat_kw)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    stream = client.chat.completions.create(**chat_kw, stream=True)
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for ch in stream:
        c = ch.choices[0]
        texts[c.index] += c.delta.content or ""
        if c.finish_reason:
            finishes[c.index].append(c.finish_reason)
    assert texts == {c.index: c.message.content for c in chat.choices}  # same seed, same samples
    assert all(len(f) == 1 for f in finishes.values())


def test_greedy_stream_equals_non_stream(client, prompts):
    """temperature=0: the streamed and the non-streamed chat completion give the same text, cold or warm."""
    kw = dict(model="smol", messages=[{"role": "user", "content": prompts[3] + " Answer in one sentence."}],
              max_tokens=12, temperature=0)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(**kw, stream=True))
    assert streamed == client.chat.completions.create(**kw).choices[0].message.content


def test_stop_string(client, prompts, oracle):
    i = next(i for i, t in enumerate(oracle) if len(t.strip()) > 6)
    text = oracle[i]
    stop = text[3:6]  # cut somewhere inside the greedy text
    cut = text[: text.find(stop)]
    resp = client.completions.create(model="smol", prompt=prompts[i], max_tokens=12, temperature=0, stop=[stop])
    assert resp.choices[0].text == cut and resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="smol", prompt=prompts[i], max_tokens=12, temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in stream) == cut  # never leaks the stop string


def test_logprobs(llm, client, prompts, oracle):
    resp = client.completions.create(model="smol", prompt=prompts[6], max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text == oracle[6][: len(resp.choices[0].text)]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy: the sampled token is the top one
        assert top[tok] == pytest.approx(logprob, abs=1e-5)
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": prompts[6]}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
               for t in content)


def test_cached_tokens_on_repeated_prompt(client, seed):
    rng = random.Random(seed + 1)  # (not the prompts' stream)
    prompt = random_prompt(rng, 150)  # far more than one block, unique to this run
    first = client.completions.create(model="smol", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="smol", prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 4 * BLOCK
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK


def test_64_concurrent_streams(server, prompts, oracle):
    async def one(c, i):
        stream = await c.completions.create(model="smol", prompt=prompts[i], max_tokens=12, temperature=0,
                                            stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120,
                               http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=100)))
        try:
            return await asyncio.gather(*(one(c, i) for i in range(64)))
        finally:
            await c.close()

    before = metrics(server)
    t0 = time.perf_counter()
    texts = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    assert texts == oracle
    assert_no_leak(wait_idle(server))
    after = metrics(server)
    assert after["pagedllm_time_to_first_token_seconds_count"] - before[
        "pagedllm_time_to_first_token_seconds_count"] == 64
    print(f"64 concurrent streams x 12 tokens: {elapsed:.2f}s")


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"model": "smol", "prompt": "Count to one thousand: 1, 2, 3,", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    before = metrics(server)
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(g.startswith("data: {") for g in got)
        # the gauges are refreshed by the engine loop every 50 ms: they may not show the request yet
        wait_until(lambda: (m := metrics(server))["pagedllm_num_requests_running"] == 1
                   and m["pagedllm_kv_cache_usage_ratio"] > 0, "the gauges to show the running request")
    # connection closed: the request must be aborted (fewer than its 900 tokens) and its blocks freed
    wait_until(lambda: metrics(server)["pagedllm_num_requests_running"] == 0, "the aborted request to stop")
    assert_no_leak(wait_idle(server))
    after = wait_until(lambda: (m := metrics(server))["pagedllm_kv_cache_usage_ratio"] == 0 and m,
                       "the KV usage gauge to drop to 0")
    generated = after["pagedllm_generation_tokens_total"] - before["pagedllm_generation_tokens_total"]
    assert generated < 900, f"the request ran to its end ({generated} tokens): it was not aborted"


def test_disconnect_non_streaming_aborts(server):
    body = {"model": "smol", "prompt": "List every prime number:", "max_tokens": 900, "ignore_eos": True}
    before = metrics(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.5,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    wait_until(lambda: metrics(server)["pagedllm_num_requests_running"] == 0, "the gone client's request to stop")
    assert_no_leak(wait_idle(server))
    generated = metrics(server)["pagedllm_generation_tokens_total"] - before["pagedllm_generation_tokens_total"]
    assert generated < 900, f"the request ran to its end ({generated} tokens): it was not aborted"


# --- bad input ---------------------------------------------------------------------------------------------
def _post(server, path, content, key=API_KEY):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(server.url + path, content=content, headers=headers)


def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["message"]
    return err


def test_bad_inputs(server, client, prompts, oracle):
    _error(_post(server, "/v1/completions", b'{"model": "smol", "prompt": "hi",'), 400)
    _error(_post(server, "/v1/chat/completions", b"not json"), 400)
    err = _error(_post(server, "/v1/completions", json.dumps({"prompt": "hi", "temperature": "hot"})), 400)
    assert err["param"] == "temperature"
    _error(_post(server, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": [3]})), 400)
    _error(_post(server, "/v1/completions", json.dumps({"prompt": "hi", "seed": 2**64})), 400)
    _error(_post(server, "/v1/completions", json.dumps({"max_tokens": 3})), 400)  # no prompt
    _error(_post(server, "/v1/chat/completions", json.dumps({"messages": []})), 400)
    for field, value in [("temperature", -1), ("top_p", 2.0), ("n", 0), ("max_tokens", 0), ("top_k", -5),
                         ("presence_penalty", 3), ("logprobs", 50), ("min_p", 1.5), ("n", 129)]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="smol", prompt="hi", extra_body={field: value})
        assert e.value.body["param"] == field, (field, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="word " * (MAX_MODEL_LEN + 10), max_tokens=4)
    assert "max_model_len" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN}])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smol", prompt=[10**9, 5], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="hi", logit_bias={str(10**7): 3.0})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    _error(httpx.get(server.url + "/v1/nothing-here", headers={"Authorization": f"Bearer {API_KEY}"}), 404)
    # nothing else was disturbed
    resp = client.completions.create(model="smol", prompt=prompts[0], max_tokens=12, temperature=0)
    assert resp.choices[0].text == oracle[0]
    assert_no_leak(wait_idle(server))


def test_api_key_required(server, prompts):
    assert _error(_post(server, "/v1/completions", json.dumps({"prompt": "x"}), key=None), 401)["code"] == (
        "invalid_api_key")
    _error(httpx.get(server.url + "/v1/models"), 401)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="smol", prompt=prompts[0], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_metrics_parse_and_move(server, client, prompts):
    text = httpx.get(server.url + "/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"pagedllm_kv_cache_usage_ratio", "pagedllm_num_requests_running", "pagedllm_num_requests_waiting",
            "pagedllm_prefix_cache_queries", "pagedllm_prefix_cache_hits", "pagedllm_num_preemptions",
            "pagedllm_prompt_tokens", "pagedllm_generation_tokens", "pagedllm_time_to_first_token_seconds",
            "pagedllm_inter_token_latency_seconds"} <= names
    before = metrics(server)
    resp = client.completions.create(model="smol", prompt=prompts[7], max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    wait_idle(server)
    # the token counters move before the response is sent; the prefix-cache ones with the loop's gauge refresh
    names = ("pagedllm_prompt_tokens_total", "pagedllm_generation_tokens_total",
             "pagedllm_prefix_cache_queries_total", "pagedllm_time_to_first_token_seconds_count",
             "pagedllm_inter_token_latency_seconds_count")
    last: dict[str, float] = {}

    def moved() -> dict[str, float] | None:
        last.update(metrics(server))
        return dict(last) if all(last[name] > before[name] for name in names) else None

    after = wait_until(moved, lambda: "these counters to move: "
                       f"{[name for name in names if last.get(name, 0) <= before[name]]}")
    assert after["pagedllm_prompt_tokens_total"] - before["pagedllm_prompt_tokens_total"] == (
        resp.usage.prompt_tokens)
    assert after["pagedllm_generation_tokens_total"] - before["pagedllm_generation_tokens_total"] == 8
    assert after["pagedllm_inter_token_latency_seconds_count"] - before[
        "pagedllm_inter_token_latency_seconds_count"] == 7


def test_extras_accepted(client, prompts):
    resp = client.completions.create(model="smol", prompt=prompts[8], max_tokens=7, temperature=0.8,
                                     presence_penalty=0.5, frequency_penalty=0.5, seed=3,
                                     extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2,
                                                 "ignore_eos": True})
    assert resp.usage.completion_tokens == 7 and resp.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3


# --- faults ------------------------------------------------------------------------------------------------
def test_request_failure_is_isolated(server, client, prompts, oracle, monkeypatch):
    processor = server.engine.engine.output_processor
    original = processor._advance  # turns one sample's new tokens into text

    def poisoned(state, sample, update, sampled):
        if state.prompt and "POISON" in state.prompt:
            raise RuntimeError("injected fault")
        return original(state, sample, update, sampled)

    monkeypatch.setattr(processor, "_advance", poisoned)

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        try:
            good = c.completions.create(model="smol", prompt=prompts[9], max_tokens=12, temperature=0)
            bad = c.completions.create(model="smol", prompt="POISON " + prompts[9], max_tokens=12)
            return await asyncio.gather(good, bad, return_exceptions=True)
        finally:
            await c.close()

    good, bad = asyncio.run(main())
    assert isinstance(bad, openai.InternalServerError), bad
    assert good.choices[0].text == oracle[9]
    stream = client.completions.create(model="smol", prompt="POISON x", max_tokens=4, stream=True)
    with pytest.raises(openai.APIError):
        list(stream)
    monkeypatch.setattr(processor, "_advance", original)
    assert_no_leak(wait_idle(server))


def test_step_failure_fails_in_flight_only(server, client, prompts, oracle, monkeypatch):
    engine = server.engine.engine
    original = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step fault")
        return original()

    monkeypatch.setattr(engine, "step", flaky_step)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="smol", prompt=prompts[10], max_tokens=12, temperature=0)
    assert_no_leak(wait_idle(server))
    resp = client.completions.create(model="smol", prompt=prompts[10], max_tokens=12, temperature=0)
    assert resp.choices[0].text == oracle[10]
    assert httpx.get(server.url + "/health").status_code == 200
