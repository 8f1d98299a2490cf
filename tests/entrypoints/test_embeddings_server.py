"""POST /v1/embeddings end to end: the real `openai` client against a live server running the pooling runner on a
tiny Qwen3 with sentence-transformers' files (last token, normalised); results equal LLM.embed's (which
tests/engine/test_embeddings.py checks against transformers)."""

from __future__ import annotations

import asyncio
import base64
import random

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402
from live_server import API_KEY, LiveServer, wait_idle  # noqa: E402
from server_harness import openai_error  # noqa: E402
from tiny_models import add_sentence_transformers_files, fresh_seed, make_tiny_model, random_prompts  # noqa: E402

from pagedllm import LLM, PoolingParams  # noqa: E402
from pagedllm.engine.async_engine import AsyncEngine  # noqa: E402
from pagedllm.entrypoints.openai.server import build_app  # noqa: E402

MAX_MODEL_LEN = 128
WORDS = "river apple orange cloud silver garden window music yellow market bridge winter forest".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("embed_server"), "qwen3")
    return add_sentence_transformers_files(path, "lasttoken", normalize=True)


def _serve(model_dir, runner: str):
    llm = LLM(str(model_dir), runner=runner, dtype="float32", attention_backend="reference", block_size=8,
              num_kv_blocks=128, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32)
    engine = AsyncEngine(llm.engine)
    engine.start()
    live = LiveServer(build_app(engine, api_key=API_KEY, served_model_name="tiny-embed"))
    live.llm, live.engine = llm, engine
    return live


def _running(model_dir, runner: str):
    live = _serve(model_dir, runner)
    with live:
        yield live
    live.engine.shutdown()


@pytest.fixture(scope="module")
def server(model_dir):
    yield from _running(model_dir, "pooling")


@pytest.fixture(scope="module")
def generating_server(model_dir):
    yield from _running(model_dir, "generate")


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def offline(server, prompts, params: PoolingParams | None = None) -> list[np.ndarray]:
    """LLM.embed on the server's own engine, run in its loop thread (the engine is used from one thread only)."""
    outs = asyncio.run(server.engine.call(lambda _: server.llm.embed(prompts, params, use_tqdm=False)))
    return [np.array(o.outputs.embedding, dtype=np.float32) for o in outs]


def texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(n)]


def test_float_and_base64_match_the_offline_api(server, client):
    inputs = texts(fresh_seed(), 5)
    want = offline(server, inputs)
    res = client.embeddings.create(model="tiny-embed", input=inputs)
    assert [d.index for d in res.data] == list(range(len(inputs)))
    for d, w in zip(res.data, want, strict=True):
        np.testing.assert_allclose(np.array(d.embedding, dtype=np.float32), w, rtol=1e-5, atol=1e-6)
        assert abs(np.linalg.norm(w) - 1) < 1e-4
    tokens = sum(len(server.llm.get_tokenizer().encode(t)) for t in inputs)
    assert res.usage.prompt_tokens == res.usage.total_tokens == tokens
    # the SDK asks for base64 itself when no format is given and decodes it; here the raw body, decoded as OpenAI's
    r = httpx.post(server.url + "/v1/embeddings", json={"input": inputs[0], "encoding_format": "base64"},
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(raw, want[0], rtol=1e-5, atol=1e-6)
    res64 = client.embeddings.create(model="tiny-embed", input=inputs[:2], encoding_format="base64")
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(res64.data[1].embedding), "<f4"), want[1], rtol=1e-5,
                               atol=1e-6)
    stats = wait_idle(server)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_token_id_inputs_and_dimensions(server, client):
    prompts = random_prompts(3, fresh_seed(), lo=2, hi=40, vocab=300)
    want = offline(server, prompts)
    one = client.embeddings.create(model="tiny-embed", input=prompts[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, want[0], rtol=1e-5, atol=1e-6)
    many = client.embeddings.create(model="tiny-embed", input=prompts, encoding_format="float")
    for d, w in zip(many.data, want, strict=True):
        np.testing.assert_allclose(d.embedding, w, rtol=1e-5, atol=1e-6)
    short = client.embeddings.create(model="tiny-embed", input=prompts, dimensions=8, encoding_format="float")
    for d, w in zip(short.data, want, strict=True):
        np.testing.assert_allclose(d.embedding, w[:8] / np.linalg.norm(w[:8]), rtol=1e-4, atol=1e-6)


def test_too_long_is_a_400_unless_truncated(server, client):
    prompt = random_prompts(1, fresh_seed(), lo=MAX_MODEL_LEN + 10, hi=MAX_MODEL_LEN + 30, vocab=300)[0]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny-embed", input=prompt)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "input"
    res = client.embeddings.create(model="tiny-embed", input=prompt, encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 20})
    np.testing.assert_allclose(res.data[0].embedding, offline(server, [prompt[-20:]])[0], rtol=1e-5, atol=1e-6)
    assert res.usage.prompt_tokens == 20
    whole = client.embeddings.create(model="tiny-embed", input=prompt[:MAX_MODEL_LEN], encoding_format="float")
    assert whole.usage.prompt_tokens == MAX_MODEL_LEN  # an embedding may fill the whole context


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 1000}, "dimensions"), ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": [[1, 2], []]}, "input")])
def test_bad_requests_are_openai_400s(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert openai_error(r, 400)["param"] == param
    stats = wait_idle(server)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_wrong_runner_is_a_400_naming_it(server, generating_server, client):
    with pytest.raises(openai.BadRequestError, match="'pooling' runner"):
        client.completions.create(model="tiny-embed", prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'pooling' runner"):
        client.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "hi"}])
    gen = openai.OpenAI(base_url=generating_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="'generate' runner"):
        gen.embeddings.create(model="tiny-embed", input="hello")
    assert gen.completions.create(model="tiny-embed", prompt="hello", max_tokens=2).choices[0].text is not None


