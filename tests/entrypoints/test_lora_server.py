"""LoRA adapters in the server (issue 57), as vLLM's: `--lora-modules`, a request's `model` naming an adapter, the
adapters in /v1/models, POST /v1/load_lora_adapter and /v1/unload_lora_adapter. The real `openai` client against a
live server on a tiny random model with two random PEFT adapters; greedy outputs equal LLM.generate's with the same
adapter (lora_request) and differ from the base model's."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")
pytest.importorskip("uvicorn")
import torch  # noqa: E402
import transformers  # noqa: E402
from live_server import serving  # noqa: E402
from tiny_models import make_llm, make_tiny_model  # noqa: E402

from pagedllm import LoRARequest, SamplingParams  # noqa: E402
from pagedllm.engine.async_engine import AsyncEngine  # noqa: E402
from pagedllm.entrypoints.openai.errors import OpenAIError  # noqa: E402
from pagedllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest  # noqa: E402
from pagedllm.entrypoints.openai.server import build_app  # noqa: E402
from pagedllm.entrypoints.openai.server import main as serve_main  # noqa: E402
from pagedllm.entrypoints.openai.serving_models import (  # noqa: E402
    LoRAModulePath,
    OpenAIServingModels,
    parse_lora_module,
)
from pagedllm.lora import LoRANotFoundError  # noqa: E402

KEY = "sk-lora"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["The river and the apple", "Write about a cloud"]
MAX_TOKENS = 8
CHAT = [{"role": "user", "content": "Tell me about silver gardens"}]


def make_adapter(base: Path, path: Path, seed: int, targets: list[str], r: int) -> str:
    """A PEFT adapter with random (non-zero) A and B, so that it changes the model's outputs."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    pm = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    pm.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root / "base", seed=3)
    return {"base": str(base), "a1": make_adapter(base, root / "a1", 1, ALL, 8),
            "a2": make_adapter(base, root / "a2", 2, ["q_proj", "v_proj"], 4),
            "big": make_adapter(base, root / "big", 3, ["q_proj"], 32)}


@pytest.fixture(scope="module")
def llm(paths):
    return make_llm(paths["base"], enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=256)


@pytest.fixture(scope="module")
def oracle(llm, paths) -> dict[str | None, dict[str, list[str]]]:
    """Greedy texts of the offline API per adapter (None: the base): completions of PROMPTS, and the chat CHAT.
    Under other names than the server's, unloaded afterwards: the server loads its own."""
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    out: dict[str | None, dict[str, list[str]]] = {}
    for i, name in enumerate((None, "a1", "a2")):
        lora = None if name is None else LoRARequest(f"offline-{name}", 100 + i, paths[name])
        out[name] = {"completions": [o.outputs[0].text for o in llm.generate(PROMPTS, sp, False, lora)],
                     "chat": [llm.chat(CHAT, sp, False, lora_request=lora)[0].outputs[0].text]}
        if lora is not None:
            llm.engine.remove_lora(lora.lora_name)
    assert out["a1"] != out[None] and out["a2"] != out[None] and out["a1"] != out["a2"], out
    return out


@pytest.fixture(scope="module")
def server(llm, paths, oracle):
    engine = AsyncEngine(llm.engine)
    app = build_app(engine, api_key=KEY, served_model_name="tiny",
                    lora_modules=[parse_lora_module(f"a1={paths['a1']}"),  # and vLLM's JSON form
                                  parse_lora_module(json.dumps({"name": "a2", "path": paths["a2"],
                                                                "base_model_name": "tiny"}))])
    with serving(engine, app) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def complete(client, model: str) -> list[str]:
    resp = client.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert resp.model == model
    return [c.text for c in resp.choices]


def chat(client, model: str) -> str:
    resp = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    return resp.choices[0].message.content


def test_models_lists_adapters_after_the_base(client, paths):
    cards = client.models.list().data
    assert [m.id for m in cards] == ["tiny", "a1", "a2"]
    assert [m.model_extra["parent"] for m in cards] == [None, "tiny", "tiny"]
    assert [m.model_extra["root"] for m in cards[1:]] == [paths["a1"], paths["a2"]]
    assert client.models.retrieve("a2").model_extra["root"] == paths["a2"]


def test_each_adapter_equals_the_offline_api(client, server, oracle):
    for model, key in (("tiny", None), ("a1", "a1"), ("a2", "a2")):
        assert complete(client, model) == oracle[key]["completions"], model
        assert chat(client, model) == oracle[key]["chat"][0], model
    # Anthropic's messages pick the adapter by `model` too
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": "a1", "max_tokens": MAX_TOKENS, "messages": CHAT, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == oracle["a1"]["chat"][0]


def test_unknown_model_is_404(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="a3", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "`a3` does not exist" in e.value.body["message"]
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": "a3", "max_tokens": 2, "messages": CHAT})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_load_use_unload(client, server, paths, oracle):
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": paths["a1"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert [m.id for m in client.models.list().data] == ["tiny", "a1", "a2", "late"]
    assert complete(client, "late") == oracle["a1"]["completions"]  # the same files as a1
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": paths["a2"]})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
    with pytest.raises(openai.NotFoundError):
        complete(client, "late")
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert [m.id for m in client.models.list().data] == ["tiny", "a1", "a2"]


def test_a_request_never_loads_an_adapter_the_server_has_not(server, paths):
    """An adapter unloaded while a request naming it was on its way is not loaded back on first use: the request
    fails (a 404 in the server) and the adapter stays gone."""
    async def add() -> None:
        await server.engine.add_request("hi", SamplingParams(max_tokens=2), lora_request=LoRARequest(
            "gone", 99, paths["a2"]))

    with pytest.raises(LoRANotFoundError):
        asyncio.run(add())
    names = asyncio.run(server.engine.call(lambda e: [lo.lora_name for lo in e.list_loras()]))
    assert names == ["a1", "a2"]


@pytest.mark.parametrize(("name", "path", "message"), [
    ("big", "big", "is above max_lora_rank 16"),
    ("nowhere", None, "no LoRA adapter here"),
    ("tiny", "a1", "is the base model's name"),
])
def test_bad_load_is_400_naming_the_problem(server, paths, name, path, message):
    lora_path = paths[path] if path else paths["base"] + "-missing"
    r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": lora_path})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.text
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400  # no lora_path


def test_concurrent_adapters_and_base_each_get_their_own(server, oracle):
    async def run() -> list[tuple[str, list[str]]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            async def one(model: str) -> tuple[str, list[str]]:
                resp = await c.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
                return model, [ch.text for ch in resp.choices]

            return await asyncio.gather(*(one(m) for m in ("a1", "tiny", "a2") * 3))

    for model, texts in asyncio.run(run()):
        assert texts == oracle[None if model == "tiny" else model]["completions"], model


def test_lora_modules_parse_and_a_server_without_lora():
    assert parse_lora_module("a=/x/y") == LoRAModulePath("a", "/x/y")
    assert parse_lora_module('{"name": "a", "path": "/p", "base_model_name": "b"}') == LoRAModulePath("a", "/p", "b")
    for bad in ("noequals", "=p", '{"name": "a"}'):
        with pytest.raises(ValueError):
            parse_lora_module(bad)

    class NoLoRA:  # an engine without --enable-lora
        model_name, lora_enabled = "m", False

    with pytest.raises(OpenAIError) as e:
        asyncio.run(OpenAIServingModels(NoLoRA()).load_lora_adapter(LoadLoRAAdapterRequest(lora_name="a",
                                                                                           lora_path="/p")))
    assert e.value.status == 400 and "--enable-lora" in e.value.message


def test_serve_refuses_a_bad_adapter_in_one_line(paths):
    base = ["--dtype", "float32", "--num-kv-blocks", "16", "--max-model-len", "64"]
    with pytest.raises(SystemExit) as e:  # --lora-modules implies --enable-lora
        serve_main([paths["base"], *base, "--lora-modules", f"big={paths['big']}"])
    assert str(e.value).startswith("pagedllm serve: error: cannot load LoRA adapter 'big' from ")
    assert "above max_lora_rank 16" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:  # before Ray is imported
        serve_main([paths["base"], *base, "--enable-lora", "--data-parallel-size", "2"])
    assert "not supported with data-parallel serving" in str(e.value)
