"""POST /v1/score and /v1/rerank (and /rerank, /v2/rerank) end to end against live servers: a tiny cross-encoder
(scores equal LLM.score's on the same engine, which tests/engine/test_encoder_engine.py checks against transformers),
a tiny BERT embedder (scores are cosines; the openai SDK's and LangChain's embeddings clients), and a generation
server, which refuses scores naming its runner."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402
from live_server import API_KEY, LiveServer  # noqa: E402
from server_harness import openai_error  # noqa: E402
from tiny_encoders import make_encoder  # noqa: E402
from tiny_models import add_sentence_transformers_files, make_tiny_model  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.engine.async_engine import AsyncEngine  # noqa: E402
from pagedllm.entrypoints.openai.server import build_app  # noqa: E402

QUERY = "where are keys and values stored?"
DOCS = ["Paged attention stores keys and values in blocks.", "The lazy dog", "Copy on write keeps prefixes intact.",
        "Héllo wörld 🙂"]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _running(path, runner: str = "pooling", **kw):
    llm = LLM(str(path), runner=runner, dtype="float32", max_model_len=48, **kw)
    engine = AsyncEngine(llm.engine)
    engine.start()
    live = LiveServer(build_app(engine, api_key=API_KEY, served_model_name="tiny"))
    live.llm, live.engine = llm, engine
    with live:
        yield live
    engine.shutdown()


@pytest.fixture(scope="module")
def cross(tmp_path_factory):
    yield from _running(make_encoder(tmp_path_factory.mktemp("ce") / "m", "bert-cls", seed=5))


@pytest.fixture(scope="module")
def bi(tmp_path_factory):
    path = make_encoder(tmp_path_factory.mktemp("bi") / "m", "bert", seed=6)
    yield from _running(add_sentence_transformers_files(path, "mean_tokens", normalize=True))


@pytest.fixture(scope="module")
def generating(tmp_path_factory):
    yield from _running(make_tiny_model(tmp_path_factory.mktemp("gen") / "m", "qwen3"), "generate",
                        attention_backend="reference", num_kv_blocks=64)


def offline(server, fn):
    """fn(llm) on the server's own engine, in its loop thread (one thread uses the engine)."""
    return asyncio.run(server.engine.call(lambda _: fn(server.llm)))


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60)


def test_rerank_and_score_on_a_cross_encoder(cross):
    want = [o.outputs.score for o in offline(cross, lambda llm: llm.score(QUERY, DOCS, use_tqdm=False))]
    best_first = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = post(cross, path, {"model": "tiny", "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"id", "model", "usage", "results"} and body["model"] == "tiny"
        assert [x["index"] for x in body["results"]] == best_first
        for x in body["results"]:
            assert abs(x["relevance_score"] - want[x["index"]]) < 1e-6
            assert x["document"] == {"text": DOCS[x["index"]]}
        assert body["usage"]["total_tokens"] == sum(len(o.prompt_token_ids) for o in offline(
            cross, lambda llm: llm.score(QUERY, DOCS, use_tqdm=False)))
    jina = post(cross, "/v1/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                                      "return_documents": False}).json()
    assert [x["index"] for x in jina["results"]] == best_first[:2]
    assert all("document" not in x for x in jina["results"])
    r = post(cross, "/v1/score", {"model": "tiny", "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and set(body) >= {"id", "data", "usage", "model"}
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score") for i in range(len(DOCS))]
    assert max(abs(d["score"] - w) for d, w in zip(body["data"], want, strict=True)) < 1e-6
    pairs = post(cross, "/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}).json()
    assert [d["score"] for d in pairs["data"]] == [d["score"] for d in body["data"][:2]]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": "", "documents": DOCS}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": QUERY * 5, "documents": DOCS}, "documents"),  # the pair is past max_model_len
    ("/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[:3]}, "text_1"),
    ("/v1/score", {"text_1": [], "text_2": DOCS}, "text_1"),
    ("/v1/score", {"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "hello"}, None),  # a cross-encoder makes no embeddings
])
def test_bad_requests_are_openai_400s(cross, path, body, param):
    err = openai_error(post(cross, path, body), 400)
    assert err["param"] == param or param is None, err
    assert openai_error(post(cross, "/v1/rerank", {"model": "nope", "query": QUERY, "documents": DOCS}),
                        404)["code"] == "model_not_found"
    assert not offline(cross, lambda llm: llm.engine.has_unfinished_requests())


def test_truncated_pair_scores(cross):
    long = QUERY * 5
    r = post(cross, "/v1/rerank", {"query": long, "documents": DOCS[:1], "truncate_prompt_tokens": 48})
    assert r.status_code == 200, r.text
    want = offline(cross, lambda llm: llm.score(long, DOCS[:1], truncate_prompt_tokens=48, use_tqdm=False))
    assert abs(r.json()["results"][0]["relevance_score"] - want[0].outputs.score) < 1e-6
    assert r.json()["usage"]["total_tokens"] == 48


def test_bi_encoder_scores_and_embedding_clients(bi):
    want = offline(bi, lambda llm: llm.embed([QUERY, *DOCS], use_tqdm=False))
    vectors = [np.array(o.outputs.embedding) for o in want]
    r = post(bi, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    for x in r.json()["results"]:
        v = vectors[1 + x["index"]]
        assert abs(x["relevance_score"] - float(vectors[0] @ v / np.linalg.norm(vectors[0]) / np.linalg.norm(v))) < 1e-5
    client = openai.OpenAI(base_url=bi.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    res = client.embeddings.create(model="tiny", input=DOCS)
    for d, v in zip(res.data, vectors[1:], strict=True):
        np.testing.assert_allclose(d.embedding, v, rtol=1e-5, atol=1e-6)
    langchain = pytest.importorskip("langchain_openai")
    lc = langchain.OpenAIEmbeddings(model="tiny", base_url=bi.url + "/v1", api_key=API_KEY,
                                    check_embedding_ctx_length=False, max_retries=0)
    np.testing.assert_allclose(lc.embed_query(QUERY), vectors[0], rtol=1e-5, atol=1e-6)
    for got, v in zip(lc.embed_documents(DOCS), vectors[1:], strict=True):
        np.testing.assert_allclose(got, v, rtol=1e-5, atol=1e-6)


def test_generation_server_refuses_scores_naming_its_runner(generating):
    for path, body in (("/v1/score", {"text_1": QUERY, "text_2": DOCS}),
                       ("/v1/rerank", {"query": QUERY, "documents": DOCS})):
        err = openai_error(post(generating, path, body), 400)
        assert "'generate' runner" in err["message"] and "--runner pooling" in err["message"]
