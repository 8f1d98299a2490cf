"""GET /kv in a real browser: the system's Chromium driven by Playwright loads the live KV map of an engine held in
a fixed state; its cell counts match kv_cache_stats() of the same snapshot, an n=4 request shows shared blocks,
and a screenshot is saved (tests/artifacts/kv_page.png). `make test` installs chromium and playwright."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (make install adds it)")
from live_server import LiveServer  # noqa: E402
from tiny_models import make_llm, make_tiny_model  # noqa: E402

from pagedllm import SamplingParams  # noqa: E402
from pagedllm.core.request import Request, RequestStatus  # noqa: E402
from pagedllm.engine.async_engine import AsyncEngine  # noqa: E402
from pagedllm.engine.kv_snapshot import kv_snapshot  # noqa: E402
from pagedllm.entrypoints.openai.server import build_app  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"  # tests/artifacts
NUM_BLOCKS = 200


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    llm = make_llm(make_tiny_model(tmp_path_factory.mktemp("tiny")), num_kv_blocks=NUM_BLOCKS, block_size=8,
                   max_model_len=512)
    engine = AsyncEngine(llm.engine)
    with LiveServer(build_app(engine)) as server:
        server.engine = engine
        yield server
    engine.shutdown()


def on_engine(live, fn):
    """fn(engine) on the engine thread, from a thread of its own: Playwright's sync API keeps an event loop
    running in this one, where asyncio.run cannot start another."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, live.engine.call(fn)).result()


def page_counts(page) -> dict:
    page.wait_for_function("document.body.dataset.snapshot !== undefined", timeout=15000)
    return json.loads(page.evaluate("document.body.dataset.snapshot"))


def hold_shared_request(engine) -> list[Request]:
    """Put the engine in a fixed state with shared blocks: one request's prompt allocated (its full blocks
    cached) and forked into three more samples (ref count 4), never stepped (no request state: the engine loop
    leaves it alone). Runs on the engine thread (AsyncEngine.call)."""
    sched = engine.scheduler
    parent = Request("held#0", [(11 * t) % 290 + 5 for t in range(45)])
    sched.add_request(parent)
    sched.schedule()
    parent.num_computed_tokens = parent.num_prompt_tokens
    children = [Request(f"held#{i}", parent.prompt_token_ids) for i in range(1, 4)]
    for child in children:
        sched.fork(parent, child)
    return [parent, *children]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine: `make install` installs it with apt-get "
                                             "(needs root and the Debian mirror)")
def test_kv_page_live(live):
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(live.url + "/kv")
            idle = page_counts(page)
            assert idle["used"] == 0 and idle["free"] + idle["cached"] == NUM_BLOCKS
            held = on_engine(live, hold_shared_request)
            # the page catches up with the held state (it polls twice a second); nothing changes meanwhile
            page.wait_for_function("JSON.parse(document.body.dataset.snapshot || '{}').shared > 0", timeout=60000)
            snap = page_counts(page)
            st = snap["stats"]
            assert snap["used"] == st["num_blocks"] - st["num_free_blocks"] == 6, snap  # 45 tokens, blocks of 8
            assert snap["used"] + snap["cached"] + snap["free"] == NUM_BLOCKS
            assert snap["cached"] == st["num_cached_free_blocks"], snap
            assert snap["shared"] == 6, snap
            page.screenshot(path=str(ARTIFACTS / "kv_page.png"), full_page=True)
            # hovering a held cell names its request and token range (polling paused: one fixed picture)
            page.evaluate("window.kvPaused = true")
            box = page.locator("#grid").bounding_box()
            cells = json.loads(page.evaluate("JSON.stringify(snap.cells)"))
            cols = page.evaluate("layout(snap.num_blocks).cols")
            b = next(i for i, v in enumerate(cells) if v >= 0)
            page.mouse.move(box["x"] + (b % cols) * 14 + 6, box["y"] + (b // cols) * 14 + 6)
            tip = page.locator("#tip").inner_text()
            assert f"block {b}: request" in tip and "tokens " in tip, tip
            assert not errors, errors
        finally:
            browser.close()
    on_engine(live, lambda e: e.scheduler.finish_requests(held, RequestStatus.FINISHED_ABORTED))
    # idle again: the page and kv_cache_stats() agree exactly
    stats = on_engine(live, lambda e: e.kv_cache_stats())
    assert stats["num_free_blocks"] == NUM_BLOCKS
    snap = on_engine(live, kv_snapshot)
    assert sum(1 for v in snap["cells"] if v == -2) == stats["num_cached_free_blocks"] > 0
    assert not snap["shared"]


def test_snapshot_cost_is_bounded(tmp_path):
    """The snapshot is one pass over the pool: time it on a large pool with many requests (reported, and only
    checked loosely: it runs between engine steps)."""
    llm = make_llm(make_tiny_model(tmp_path / "m"), num_kv_blocks=20000, block_size=8, max_model_len=2048)
    prompts = [[(7 * i + j) % 300 + 3 for j in range(600)] for i in range(24)]
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)  # leaves cached blocks behind
    t0 = time.perf_counter()
    snap = kv_snapshot(llm.engine)
    elapsed = time.perf_counter() - t0
    print(f"kv_snapshot of {snap['num_blocks']} blocks: {elapsed * 1e3:.1f} ms")  # reported, not asserted
    assert sum(1 for v in snap["cells"] if v == -2) == llm.engine.kv.block_pool.num_cached_free_blocks() > 0
