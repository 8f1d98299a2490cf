"""Schema fuzzing of the OpenAI endpoints: request bodies drawn from the app's own OpenAPI request schemas
(hypothesis-jsonschema) get a 2xx or an OpenAI-shaped 4xx, never a 5xx; afterwards the greedy answer is
unchanged and no KV block is held."""

from __future__ import annotations

import json

import pytest
from server_harness import (
    API_KEY,
    LiveServer,
    assert_idle_no_leak,
    greedy_text,
    openai_error,
    tiny_async_engine,
)
from tiny_models import make_tiny_model

hypothesis = pytest.importorskip("hypothesis")
hjs = pytest.importorskip("hypothesis_jsonschema")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.internal.conjecture import utils as _cu  # noqa: E402

from pagedllm.entrypoints.openai.server import build_app  # noqa: E402


class _Many:
    """hypothesis-jsonschema 0.23 draws object properties with the old `cu.many(...).more()` protocol, which
    newer Hypothesis replaced by a context manager; this is that old protocol on top of draw_boolean."""

    def __init__(self, data, min_size: int, max_size: float, average_size: float) -> None:
        self.data, self.min_size, self.max_size = data, min_size, max_size
        self.p_continue = 1.0 - 1.0 / (1.0 + max(average_size - min_size, 0.0))
        self.count = self.rejections = 0
        self.force_stop = False

    def more(self) -> bool:
        if self.count < self.min_size:
            go = True
        elif self.force_stop or self.count >= self.max_size:
            go = False
        else:
            go = self.data.draw_boolean(self.p_continue)
        self.count += go
        return go

    def reject(self) -> None:
        self.count -= 1
        self.rejections += 1
        if self.rejections > max(3, 2 * self.count):
            if self.count < self.min_size:
                self.data.mark_invalid()
            self.force_stop = True


if not hasattr(_cu.many, "more"):
    import hypothesis_jsonschema._from_schema as _hjs_impl

    _hjs_impl.cu = type("cu", (), {"many": _Many})

PROMPT = "Paged attention stores keys and values in blocks."
ENDPOINTS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}
# Bounds on how much work one example may ask for (the schema allows max_tokens=2**31, n=128): the fuzz is
# about what the server accepts, not about generating long texts on a 2-core machine.
WORK_CAPS = {"max_tokens": 6, "max_completion_tokens": 6, "n": 3, "best_of": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = tiny_async_engine(make_tiny_model(tmp_path_factory.mktemp("fuzz_model"), "llama", seed=7))
    app = build_app(engine, api_key=API_KEY, served_model_name="tiny")
    with LiveServer(app) as live:
        live.engine = engine
        live.reference = greedy_text(live, PROMPT)
        live.schemas = {path: request_schema(app.openapi(), name) for path, name in ENDPOINTS.items()}
        yield live
    engine.shutdown()


def request_schema(openapi: dict, name: str) -> dict:
    """The JSON schema of one request model, its $refs resolvable (they point into components)."""
    return {**openapi["components"]["schemas"][name], "components": openapi["components"]}


def bounded(body: object) -> object:
    if isinstance(body, dict):
        for key, cap in WORK_CAPS.items():
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > cap:
                body[key] = cap
    return body


def test_schema_fuzz_never_5xx(server):
    strategies = {path: hjs.from_schema(schema) for path, schema in server.schemas.items()}
    seen: dict[int, int] = {}

    @settings(max_examples=30, deadline=None, derandomize=False, database=None,
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(sorted(strategies)), data=st.data(), drop_model=st.booleans())
    def check(path, data, drop_model):
        body = bounded(data.draw(strategies[path]))
        if drop_model and isinstance(body, dict):
            body.pop("model", None)  # else most bodies stop at the model check (404)
        r = server.post(path, json.dumps(body), timeout=60)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
        if r.status_code >= 400:
            openai_error(r, r.status_code)

    check()
    assert any(s < 300 for s in seen) and any(400 <= s < 500 for s in seen), seen  # both kinds were reached
    assert greedy_text(server, PROMPT) == server.reference
    assert_idle_no_leak(server.engine)
