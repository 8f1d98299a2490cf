"""Soak: N mixed requests (valid, invalid, disconnecting) against a live `pagedllm serve`; RSS growth, 5xx, hangs.

The server is started by the command (a child process with a small KV cache and an API key). Requests come from
a seeded mix of probe categories, a few at a time; each must end within --request-timeout (else it is a hang).
The server's RSS is sampled every --sample-every requests. Pass: no 5xx, no hang, no valid request refused and
no invalid one accepted, RSS growth over the second half under 1%, and, once idle, every KV block free and no
request left (from /metrics). Prints the probe table (tried / 2xx / 4xx / 5xx / hangs per category)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from pagedllm_bench import common
from pagedllm_bench.serving import PagedllmServer

API_KEY = "sk-soak"
WORDS = "river apple cloud silver garden window music market bridge winter forest planet castle paper".split()


@dataclass
class Probe:
    """One request to send: what it is and what a healthy server answers."""

    path: str
    body: bytes | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    method: str = "POST"
    expect: str = "2xx"  # "2xx", "4xx", or "any" (the client leaves before the answer)
    stream: bool = False
    leave_after_events: int | None = None  # stream: disconnect after this many events
    leave_after_s: float | None = None  # non-stream: disconnect after this long


@dataclass
class Tally:
    tried: int = 0
    ok_2xx: int = 0
    err_4xx: int = 0
    err_5xx: int = 0
    hangs: int = 0
    left: int = 0  # the client disconnected on purpose
    transport_errors: int = 0
    unexpected: int = 0  # a valid request refused, an invalid one accepted, a stream without its end


def _auth(key: str = API_KEY) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {key}"), ("Content-Type", "application/json")]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _completion(rng: random.Random, **extra) -> bytes:
    return json.dumps({"prompt": _text(rng, rng.randint(3, 30)), "max_tokens": rng.randint(1, 12),
                       "temperature": rng.choice([0, 0.7, 1.0]), **extra}).encode()


def _chat(rng: random.Random, **extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": _text(rng, rng.randint(3, 20))}],
                       "max_tokens": rng.randint(1, 12), **extra}).encode()


# (unknown fields such as {"frobnicate": 1} and a logit_bias of known token ids are valid: accepted, as vLLM does)
_BAD_PARAMS = [{"temperature": "NaN"}, {"temperature": "Infinity"}, {"repetition_penalty": "-Infinity"},
               {"top_p": 2.0}, {"n": 0}, {"max_tokens": -1}, {"logit_bias": {"five": 1}},
               {"logit_bias": {"10000000": 1}}, {"seed": 2**70}, {"top_k": -5}, {"logprobs": 99}, {"stop": [""]}]
_SURROGATE_BODIES = [b'{"prompt": "a\\ud800b", "max_tokens": 2}', b'{"prompt": "x", "model": "\\udfff"}',
                     b'{"prompt": ["ok", "\\ud83d"], "max_tokens": 2}']


def _bad_param_body(rng: random.Random) -> bytes:
    bad = dict(rng.choice(_BAD_PARAMS))
    text = json.dumps({"prompt": "hi", "max_tokens": 2, **bad})
    return text.replace('"NaN"', "NaN").replace('"Infinity"', "Infinity").replace('"-Infinity"', "-Infinity").encode()


def probe_factories(max_model_len: int, kv_tokens: int, body_cap: int) -> dict[str, tuple[float, Callable]]:
    """category -> (weight, rng -> Probe)."""
    a = _auth()
    return {
        "valid_completion": (20, lambda r: Probe("/v1/completions", _completion(r), a)),
        "valid_stream": (15, lambda r: Probe("/v1/completions", _completion(r, stream=True), a, stream=True)),
        "valid_chat": (6, lambda r: Probe("/v1/chat/completions", _chat(r), a)),
        "valid_chat_stream": (6, lambda r: Probe("/v1/chat/completions", _chat(r, stream=True), a, stream=True)),
        "valid_n_logprobs": (5, lambda r: Probe("/v1/completions", _completion(r, n=3, logprobs=2), a)),
        "disconnect_stream": (8, lambda r: Probe("/v1/completions", _completion(r, stream=True, max_tokens=64,
                                                                                  ignore_eos=True), a,
                                                 expect="any", stream=True, leave_after_events=r.randint(0, 3))),
        "disconnect_plain": (5, lambda r: Probe("/v1/completions", _completion(r, max_tokens=64, ignore_eos=True),
                                                a, expect="any", leave_after_s=r.uniform(0.01, 0.3))),
        "invalid_json": (5, lambda r: Probe("/v1/completions", r.choice([b'{"prompt": "x",', b"null", b"[]",
                                                                         b"\xff\xfe", b""]), a, expect="4xx")),
        "invalid_params": (8, lambda r: Probe("/v1/completions", _bad_param_body(r), a, expect="4xx")),
        "lone_surrogate": (4, lambda r: Probe("/v1/completions", r.choice(_SURROGATE_BODIES), a, expect="4xx")),
        "prompt_too_long": (3, lambda r: Probe("/v1/completions", json.dumps(
            {"prompt": r.choice([[5] * (max_model_len + 1), "fox " * (max_model_len + 8)]),
             "max_tokens": 2}).encode(), a, expect="4xx")),
        "body_over_cap": (1, lambda r: Probe("/v1/completions", json.dumps(
            {"prompt": "x" * (body_cap + 10)}).encode(), a, expect="4xx")),
        "over_kv_capacity": (1, lambda r: Probe("/v1/completions", json.dumps(
            {"prompt": _text(r, 8), "max_tokens": kv_tokens + 64, "ignore_eos": True}).encode(), a,
            expect="2xx_or_4xx")),
        "auth": (5, lambda r: Probe("/v1/models", None, r.choice(
            [[], [("Authorization", "Bearer wrong")], [("Authorization", "Basic " + API_KEY)],
             [("Authorization", "Bearer " + API_KEY), ("Authorization", "Bearer wrong")]]), "GET", "4xx")),
        "auth_lowercase": (2, lambda r: Probe("/v1/models", None, [("Authorization", "bearer " + API_KEY)], "GET")),
        "not_found": (3, lambda r: Probe(r.choice(["/v1/nothing", "/docs", "/openapi.json"]), None, a, "GET",
                                         "4xx")),
    }


def _classify(tally: Tally, probe: Probe, status: int | None, complete: bool) -> None:
    if status is None:
        return
    if 200 <= status < 300:
        tally.ok_2xx += 1
    elif 400 <= status < 500:
        tally.err_4xx += 1
    elif status >= 500:
        tally.err_5xx += 1
    kind = "2xx" if 200 <= status < 300 else "4xx" if 400 <= status < 500 else "5xx"
    if probe.expect != "any" and kind not in probe.expect.split("_or_") or not complete:
        tally.unexpected += 1


def _is_openai_shaped(status: int, body: bytes) -> bool:
    """A 4xx/5xx body must be {"error": {"message": ...}}; a 2xx one any JSON."""
    try:
        d = json.loads(body)
    except ValueError:
        return False
    return status < 400 or isinstance(d, dict) and isinstance(d.get("error"), dict) and bool(d["error"].get("message"))


async def _read_stream(r, probe: Probe, tally: Tally) -> bool | None:
    """True if the stream ended with [DONE]; None if we left it on purpose."""
    events, last = 0, ""
    async for line in r.aiter_lines():
        if line.startswith("data:"):
            events += 1
            last = line.strip()
            if probe.leave_after_events is not None and events > probe.leave_after_events:
                tally.left += 1
                return None
    return last == "data: [DONE]"


async def _send(client, url: str, probe: Probe, tally: Tally, timeout: float, log: list[str]) -> None:
    tally.tried += 1
    status, complete = None, True
    try:
        async with asyncio.timeout(timeout):
            req = client.build_request(probe.method, url + probe.path, content=probe.body, headers=probe.headers)
            if probe.leave_after_s is not None:
                try:
                    async with asyncio.timeout(probe.leave_after_s):
                        status = (await client.send(req)).status_code
                except TimeoutError:
                    tally.left += 1
                    return
            else:
                r = await client.send(req, stream=True)
                status = r.status_code
                try:
                    if probe.stream and status == 200:
                        complete = await _read_stream(r, probe, tally)
                        if complete is None:
                            return
                    else:
                        complete = _is_openai_shaped(status, await r.aread())
                finally:
                    await r.aclose()
    except TimeoutError:
        tally.hangs += 1
        log.append(f"hang: {probe.path} {(probe.body or b'')[:120]!r}")
        return
    except Exception as e:  # noqa: BLE001 - counted, the soak goes on
        tally.transport_errors += 1
        log.append(f"transport error {type(e).__name__}: {e} on {probe.path}")
        return
    _classify(tally, probe, status, complete)
    if status is not None and (status >= 500 or probe.expect != "any" and not complete):
        log.append(f"{status} on {probe.path} {(probe.body or b'')[:120]!r}")


# ---- the run -----------------------------------------------------------------------------------------------
def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def _engine_idle_state(client, url: str, timeout: float = 60.0) -> dict[str, float]:
    """Running/waiting requests and KV usage from /metrics, once nothing runs or waits (or at the timeout)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get(url + "/metrics")).text
        vals = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        state = {k: vals.get(f"pagedllm_{k}", float("nan"))
                 for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio")}
        if state["num_requests_running"] == 0 and state["num_requests_waiting"] == 0 or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.25)


async def soak(url: str, pid: int, args: argparse.Namespace, factories: dict) -> dict:
    import httpx

    rng = random.Random(args.seed)
    names = list(factories)
    weights = [factories[n][0] for n in names]
    tallies = {n: Tally() for n in names}
    log: list[str] = []
    rss: list[tuple[int, float]] = [(0, _rss_mb(pid))]
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def one(name: str, probe: Probe) -> None:
            try:
                await _send(client, url, probe, tallies[name], args.request_timeout, log)
            finally:
                sem.release()

        pending: set[asyncio.Task] = set()
        for i in range(args.num_requests):
            name = rng.choices(names, weights)[0]
            await sem.acquire()  # at most `concurrency` in flight (released by the request's task)
            pending.add(asyncio.create_task(one(name, factories[name][1](rng))))
            pending = {t for t in pending if not t.done()}
            if (i + 1) % args.sample_every == 0:
                rss.append((i + 1, _rss_mb(pid)))
                print(f"{i + 1} requests, server RSS {rss[-1][1]:.1f} MB, {time.perf_counter() - t0:.0f}s",
                      file=sys.stderr, flush=True)
        await asyncio.gather(*pending)
        idle = await _engine_idle_state(client, url)
    if rss[-1][0] != args.num_requests:
        rss.append((args.num_requests, _rss_mb(pid)))
    return {"tallies": tallies, "rss": rss, "idle": idle, "log": log[:50], "elapsed_s": time.perf_counter() - t0}


def _growth_second_half(rss: list[tuple[int, float]]) -> float:
    """Relative RSS growth from the sample nearest the middle of the run to the last one."""
    n = rss[-1][0]
    mid = min(rss, key=lambda s: abs(s[0] - n / 2))
    return (rss[-1][1] - mid[1]) / mid[1]


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p, "300 requests, RSS sampled every 50")
    p.add_argument("--num-requests", type=int, default=None, help="default 10000 (--quick: 300)")
    p.add_argument("--sample-every", type=int, default=None, help="RSS sample interval (default 500, quick 50)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request is a hang")
    p.add_argument("--num-kv-blocks", type=int, default=64, help="the server's KV cache (small on purpose)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    p.add_argument("--skip", default="", help="comma list of probe categories to leave out")
    p.add_argument("--server-args", default="", help="extra `pagedllm serve` arguments, space separated")


def run(args: argparse.Namespace) -> dict:
    args.num_requests = args.num_requests or (300 if args.quick else 10_000)
    args.sample_every = args.sample_every or (50 if args.quick else 500)
    kv_tokens = args.num_kv_blocks * 16
    factories = {k: v for k, v in probe_factories(args.max_model_len, kv_tokens, args.max_request_body_bytes).items()
                 if k not in set(filter(None, args.skip.split(",")))}
    server_args = ["--num-kv-blocks", str(args.num_kv_blocks), "--block-size", "16", "--max-model-len",
                   str(args.max_model_len), "--max-request-body-bytes", str(args.max_request_body_bytes),
                   "--api-key", API_KEY, "--seed", str(args.seed), *args.server_args.split()]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with PagedllmServer(args.model, args.dtype, args.threads, server_args) as srv:
        res = asyncio.run(soak(srv.url, srv.proc.pid, args, factories))
    tallies: dict[str, Tally] = res["tallies"]
    total = Tally(**{k: sum(getattr(t, k) for t in tallies.values()) for k in asdict(Tally())})
    rows = [{"category": n, **asdict(t)} for n, t in tallies.items()] + [{"category": "TOTAL", **asdict(total)}]
    print(common.table(rows, title=f"soak: {args.num_requests} requests, {args.concurrency} at a time, "
                                   f"{res['elapsed_s']:.0f}s"))
    growth = _growth_second_half(res["rss"])
    idle = res["idle"]
    checks = {
        "zero 5xx": total.err_5xx == 0,
        "zero hangs": total.hangs == 0,
        "zero unexpected answers": total.unexpected == 0,
        "RSS growth over the second half < 1%": growth < 0.01,
        "idle: no request left": idle["num_requests_running"] == 0 and idle["num_requests_waiting"] == 0,
        "idle: every KV block free": idle["kv_cache_usage_ratio"] == 0,
    }
    print("RSS (MB) by requests: " + ", ".join(f"{n}: {m:.1f}" for n, m in res["rss"]))
    print(f"RSS growth over the second half: {100 * growth:+.2f}%; idle state: {idle}")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for line in res["log"][:10]:
        print("  " + line)
    payload = {"bench": "soak", "env": common.environment(args.threads), "num_requests": args.num_requests,
               "elapsed_s": res["elapsed_s"],
               "concurrency": args.concurrency, "server_args": server_args, "rows": rows, "rss_mb": res["rss"],
               "rss_growth_second_half": growth, "idle": idle, "checks": checks, "log": res["log"]}
    jp, _ = common.save("soak" + args.tag, payload, None, args.out_dir)
    print(f"wrote {jp}")
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        raise RuntimeError("soak failed: " + "; ".join(failed))
    return payload
