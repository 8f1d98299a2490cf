"""OpenAI/vLLM compatibility of the server (issue 18): the real `openai` client against a live server on a tiny
random model: unknown fields, 400 errors, the vLLM sampling extras as real behaviours, chat-template controls,
/tokenize /detokenize /version /reset_prefix_cache, metric names and values, the stats and request logs."""

from __future__ import annotations

import logging
import os

import httpx
import pytest

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from live_server import serving  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tiny_models import make_llm, make_tiny_model, wait_until  # noqa: E402

from pagedllm.engine.async_engine import AsyncEngine  # noqa: E402
from pagedllm.entrypoints.openai.server import build_app  # noqa: E402

KEY = "sk-compat"
NUM_BLOCKS = 96
BLOCK = 8


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return make_llm(make_tiny_model(tmp_path_factory.mktemp("tiny")), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
                    max_model_len=256)


@pytest.fixture(scope="module")
def server(llm):
    engine = AsyncEngine(llm.engine, log_stats_interval=0.2, log_requests=True)
    app = build_app(engine, api_key=[KEY, "sk-second"], served_model_name=["tiny", "tiny-alias"],
                    allowed_origins=["http://example.test"], trust_request_chat_template=True)
    with serving(engine, app) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def token_id(llm, text: str) -> int:
    (tid,) = llm.get_tokenizer().encode(text, add_special_tokens=False)
    return tid


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def metric_values(server) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def wait_idle(server, timeout: float = 60.0) -> None:
    def idle() -> bool:
        stats = server.engine.cached_stats()
        return not stats.get("num_running", 1) and not stats.get("num_waiting")

    wait_until(idle, lambda: f"the engine to go idle (last stats: {server.engine.cached_stats()})", timeout,
               interval=0.05)


# --- requests ------------------------------------------------------------------------------------------------
def test_unknown_fields_accepted_and_logged_once(client, caplog):
    caplog.set_level(logging.WARNING, logger="pagedllm.entrypoints.openai.serving")
    for _ in range(2):
        resp = client.completions.create(model="tiny", prompt="The fox", max_tokens=2,
                                         extra_body={"frobnicate_xyz": 1, "langchain_thing": {"a": 1}})
        assert resp.choices[0].text is not None
    warnings = [r.getMessage() for r in caplog.records if "frobnicate_xyz" in r.getMessage()]
    assert len(warnings) == 1 and "langchain_thing" in warnings[0], warnings
    resp = client.chat.completions.create(model="tiny-alias", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, extra_body={"some_new_openai_field": True})
    assert resp.choices[0].message.role == "assistant"


def test_validation_errors_are_400_naming_the_parameter(client):
    for body, param in [({"temperature": "hot"}, "temperature"), ({"max_tokens": [3]}, "max_tokens"),
                        ({"min_tokens": -1}, "min_tokens"), ({"logit_bias": {"1": "x"}}, "logit_bias"),
                        ({"allowed_token_ids": []}, "allowed_token_ids"),
                        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"logit_bias": {"99999": 1}}, "logit_bias")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=body)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (body, e.value.body)


def test_logit_bias_allowed_token_ids_bad_words(client, llm):
    z = token_id(llm, "z")
    resp = client.completions.create(model="tiny", prompt="The fox", max_tokens=6, temperature=0,
                                     logit_bias={str(z): 100})
    assert resp.choices[0].text == "z" * 6
    allowed = [token_id(llm, "a"), token_id(llm, "b")]
    resp = client.completions.create(model="tiny", prompt="The fox", max_tokens=12, temperature=1.0, seed=3,
                                     extra_body={"allowed_token_ids": allowed})
    assert set(resp.choices[0].text) <= {"a", "b"} and len(resp.choices[0].text) == 12
    # a banned word beats even a +100 bias
    resp = client.completions.create(model="tiny", prompt="The fox", max_tokens=6, temperature=0,
                                     logit_bias={str(z): 100}, extra_body={"bad_words": ["z"]})
    assert "z" not in resp.choices[0].text and len(resp.choices[0].text) > 0


def test_min_tokens_and_include_stop_str(client, llm):
    eos = llm.get_tokenizer().eos_token_id
    resp = client.completions.create(model="tiny", prompt="The fox", max_tokens=20, temperature=0,
                                     logit_bias={str(eos): 100})
    assert resp.usage.completion_tokens == 1 and resp.choices[0].finish_reason == "stop"
    resp = client.completions.create(model="tiny", prompt="The fox", max_tokens=20, temperature=0,
                                     logit_bias={str(eos): 100}, extra_body={"min_tokens": 5})
    assert resp.usage.completion_tokens == 6 and resp.choices[0].finish_reason == "stop"
    z = str(token_id(llm, "z"))
    kept = client.completions.create(model="tiny", prompt="The fox", max_tokens=8, temperature=0, stop=["zz"],
                                     logit_bias={z: 100}, extra_body={"include_stop_str_in_output": True})
    cut = client.completions.create(model="tiny", prompt="The fox", max_tokens=8, temperature=0, stop=["zz"],
                                    logit_bias={z: 100})
    assert (kept.choices[0].text, cut.choices[0].text) == ("zz", "")
    assert kept.choices[0].finish_reason == cut.choices[0].finish_reason == "stop"


def test_truncate_request_id_priority_fingerprint(client):
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 4
    full = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=1)
    cut = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": 7, "request_id": "my-req-1",
                                                "priority": 5})
    assert full.usage.prompt_tokens > 7 and cut.usage.prompt_tokens == 7
    assert cut.id == "my-req-1" and cut.system_fingerprint.startswith("pagedllm-")
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert chat.system_fingerprint.startswith("pagedllm-")


def test_continuous_usage_stats(client):
    stream = client.completions.create(model="tiny", prompt="The fox", max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1].usage.completion_tokens == 6


def test_chat_template_controls(server, client):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello wor"}]

    def text(**kw) -> str:
        r = post(server, "/tokenize", {"messages": messages, **kw})
        assert r.status_code == 200, r.text
        return post(server, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]

    assert text().endswith("<|im_start|>assistant\n")
    assert text(add_generation_prompt=False).endswith("Hello wor<|im_end|>\n")
    assert text(add_generation_prompt=False, continue_final_message=True).endswith("Hello wor")
    own = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert text(chat_template=own, chat_template_kwargs={"greeting": "HEY"}) == "HEY[hi][Hello wor]"
    templated = post(server, "/tokenize", {"messages": messages, "chat_template": own,
                                           "chat_template_kwargs": {"greeting": "HEY"}}).json()["count"]
    c = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, extra_body={
        "chat_template": own, "chat_template_kwargs": {"greeting": "HEY"}})
    assert c.usage.prompt_tokens == templated
    # the same controls on /v1/chat/completions (usage counts the templated prompt)
    a = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    b = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert a.usage.prompt_tokens < b.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                       extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


def test_sandboxed_chat_template(client, llm):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       extra_body={"chat_template": evil})
    assert "sandbox" in e.value.message and e.value.body["param"] == "messages"
    with pytest.raises(ValueError, match="sandbox"):
        llm.engine.apply_chat_template([{"role": "user", "content": "x"}],
                                       chat_template="{{ ''.__class__.__base__.__subclasses__() }}")


# --- endpoints -----------------------------------------------------------------------------------------------
def test_tokenize_detokenize_version_models(server, client, llm):
    r = post(server, "/tokenize", {"prompt": "The quick brown fox", "return_token_strs": True})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["tokens"] == llm.engine.tokenize("The quick brown fox") and d["count"] == len(d["tokens"])
    assert d["max_model_len"] == 256 and len(d["token_strs"]) == d["count"]
    assert post(server, "/detokenize", {"tokens": d["tokens"]}).json()["prompt"] == "The quick brown fox"
    assert post(server, "/detokenize", {"tokens": [10**6]}).status_code == 400
    assert post(server, "/tokenize", {}).status_code == 400
    assert httpx.get(server.url + "/version").json()["version"]
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert all(m.model_extra["max_model_len"] == 256 for m in models.data)


def test_reset_prefix_cache_behind_the_key(server, client):
    client.completions.create(model="tiny", prompt="Paged attention stores keys and values " * 3, max_tokens=1)
    wait_idle(server)
    assert post(server, "/reset_prefix_cache", {}, key=None).status_code == 401
    r = post(server, "/reset_prefix_cache", {}, key="sk-second")  # any of the keys
    assert r.status_code == 200 and r.json() == {"reset": True}
    stats = httpx.get(server.url + "/kv/snapshot").json()["stats"]
    assert stats["num_cached_blocks"] == 0
    r = httpx.get(server.url + "/kv/snapshot?replica=1")  # one engine: replica 0 only
    assert r.status_code == 400 and r.json()["error"]["param"] == "replica"


def test_cors_preflight(server):
    r = httpx.options(server.url + "/v1/completions", headers={
        "Origin": "http://example.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://example.test"
    r = httpx.options(server.url + "/v1/completions", headers={
        "Origin": "http://evil.test", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


# --- the operator's view -------------------------------------------------------------------------------------
def test_metrics_names_and_values(server, client):
    wait_idle(server)
    before = metric_values(server)
    client.completions.create(model="tiny", prompt="The fox jumps", max_tokens=5, n=2, temperature=0.5,
                              extra_body={"ignore_eos": True})
    wait_idle(server)

    def refreshed() -> dict[tuple[str, tuple], float] | None:
        """The metrics once the loop's gauge refresh (every 50 ms) has seen the request come and go."""
        m = metric_values(server)
        queried = m.get(("pagedllm_prefix_cache_queries_total", ()), 0.0) > before.get(
            ("pagedllm_prefix_cache_queries_total", ()), 0.0)
        return m if queried and m.get(("pagedllm_kv_cache_blocks", (("state", "used"),))) == 0 else None

    after = wait_until(refreshed, "the gauges to show the request's prefix-cache queries and no block in use")

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"pagedllm_{h}_count") == 1, h
    assert delta("pagedllm_request_generation_tokens_sum") == 10
    assert delta("pagedllm_generation_tokens_total") == 10
    assert delta("pagedllm_inter_token_latency_seconds_count") == 4  # 5 steps, both samples advance together
    assert delta("pagedllm_request_success_total", finished_reason="length") == 2
    blocks = {s: after[("pagedllm_kv_cache_blocks", (("state", s),))] for s in ("used", "cached", "free")}
    assert sum(blocks.values()) == NUM_BLOCKS and blocks["used"] == 0 and blocks["cached"] > 0
    stats = server.engine.cached_stats()
    assert blocks["cached"] == stats["num_cached_free_blocks"]
    assert after[("pagedllm_prefix_cache_queries_total", ())] == stats["prefix_cache_queries"]
    for name in ("pagedllm_kv_cache_usage_ratio", "pagedllm_num_requests_running", "pagedllm_num_requests_waiting",
                 "pagedllm_prefix_cache_hits_total", "pagedllm_num_preemptions_total",
                 "pagedllm_prompt_tokens_total"):
        assert (name, ()) in after, name


def test_stats_line_and_request_log(server, client, caplog):
    caplog.set_level(logging.INFO)
    client.completions.create(model="tiny", prompt="Copy on write keeps secrets", max_tokens=40,
                              extra_body={"ignore_eos": True})
    wait_until(lambda: [r for r in caplog.records if r.name == "pagedllm.stats"], "a pagedllm.stats log line",
               interval=0.05)
    line = [r.getMessage() for r in caplog.records if r.name == "pagedllm.stats"][0]
    for part in ("Avg prompt throughput", "Avg generation throughput", "Running:", "Waiting:", "KV cache usage",
                 "Prefix cache hit rate", "Preemptions"):
        assert part in line, line
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "pagedllm.engine.async_engine")
    assert "Added request cmpl-" in logged and "max_tokens=40" in logged
    assert "Finished request cmpl-" in logged and "'length'" in logged
    assert "Copy on write keeps secrets" not in logged  # no prompt text without log_prompts


def test_prompt_logprobs_in_responses(server, client, llm):
    resp = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=1,
                                     extra_body={"prompt_logprobs": 2})
    plp = resp.choices[0].model_extra["prompt_logprobs"]
    ids = llm.engine.tokenize("The quick brown fox")
    assert plp[0] is None and len(plp) == len(ids)
    assert all(str(t) in plp[p] and plp[p][str(t)]["logprob"] <= 0 for p, t in enumerate(ids) if p)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3
