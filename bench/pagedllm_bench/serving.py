"""Online serving: Poisson arrivals at several rates against `pagedllm serve` and llama-server, one async client.

`pagedllm bench serving [--quick] [--rates 0.25,0.5,1,2] [--num-requests 200]`; with `--concurrency 1,4,16,64` a
closed-loop sweep instead (serving_sweep.py). Each rate gets its own seeded
offline-distribution workload (so no prompt repeats across rates and neither server can reuse a cached prefix);
both servers see the same prompts and arrival times at a rate. The client streams /v1/completions with token-id
prompts, ignore_eos and temperature 0, and records TTFT (first streamed token), inter-token latency (gaps between
token chunks) and end-to-end latency per request. Reports p50/p99 of each, throughput, and the rate at which each
system's p99 TTFT passes 2 s. With `--data-parallel-size N` it compares N Ray replicas with one engine of the
same total threads on a prefix-heavy workload instead (see serving_dp.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from pagedllm_bench import common, serving_dp, serving_sweep

TTFT_SLO_S = 2.0


# ---- servers (our own child processes) ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    name = "server"
    extra_body: dict = {}

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.load_s = float("nan")
        self.log_path = common.out_path(f"{self.name}-server", "log")

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict:
        return dict(os.environ)

    def __enter__(self):
        t0 = time.perf_counter()
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=self.env())
        try:
            self._wait_ready(timeout=600)
        except BaseException:  # __exit__ does not run when __enter__ raises: stop the server here
            self.__exit__(None, None, None)
            raise
        self.load_s = time.perf_counter() - t0
        import httpx

        models = httpx.get(self.url + "/v1/models", timeout=10).json().get("data") or [{}]
        self.extra_body = {**self.extra_body, "model": models[0].get("id", "default")}
        return self

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout}s; see {self.log_path}")

    def peak_rss_mb(self) -> float:
        return common.peak_rss_mb(self.proc.pid)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class PagedllmServer(_Server):
    name = "pagedllm-serve"

    def __init__(self, model: str | None, dtype: str, threads: int, extra_args: list[str] | None = None) -> None:
        super().__init__()
        self.model, self.dtype, self.threads, self.extra_args = model, dtype, threads, extra_args or []

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(self.port), "--dtype", self.dtype,
               "--uvicorn-log-level", "warning", *self.extra_args]
        return cmd + (["--model", self.model] if self.model else [])

    def env(self) -> dict:
        return {**os.environ, "OMP_NUM_THREADS": str(self.threads), "HF_HUB_OFFLINE": "1"}


class LlamaServer(_Server):
    """llama-server of a llama.cpp-family peer (common.LLAMA_PEERS)."""

    # cache_prompt off: no slot reuses a previous prompt's KV (our prompts never repeat anyway)
    extra_body = {"cache_prompt": False}

    def __init__(self, model: str | None, threads: int, parallel: int, ctx_per_slot: int = 1024,
                 extra_args: list[str] | None = None, peer: common.LlamaPeer = common.LLAMA_CPP) -> None:
        self.peer, self.name = peer, peer.server
        super().__init__()  # (which names the log after self.name)
        self.exe = peer.tool("llama-server")
        if not self.exe:
            raise FileNotFoundError(f"{peer.name}'s llama-server not found: run `make bench-setup`"
                                    + (" IK_LLAMA_SRC=path" if peer.prefix else ""))
        self.model = model or common.default_model_path()
        self.threads, self.parallel, self.ctx_per_slot = threads, parallel, ctx_per_slot
        self.extra_args = extra_args or []

    def command(self) -> list[str]:
        return [self.exe, "-m", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(self.threads), "-tb", str(self.threads), "-np", str(self.parallel),
                "-c", str(self.parallel * self.ctx_per_slot), "-cb", *self.peer.server_args, *self.extra_args]

    def completion(self, prompt: list[int], n: int, timeout: float = 600, **options) -> dict:
        """One greedy /completion of n tokens after the token ids `prompt` (no prompt cache): llama-server's JSON,
        with its own prompt and decode `timings`."""
        import httpx

        body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "cache_prompt": False, **options}
        if not self.peer.stream_completions:
            r = httpx.post(self.url + "/completion", json=body, timeout=timeout)
            r.raise_for_status()
            return r.json()
        content, last = [], {}
        with httpx.stream("POST", self.url + "/completion", json={**body, "stream": True}, timeout=timeout) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data:"):
                    last = json.loads(line[5:])
                    content.append(last.get("content", ""))
        return {**last, "content": "".join(content)}


# the serving benches' system names of the llama.cpp-family servers
PEER_SERVERS = {p.server: p for p in common.LLAMA_PEERS.values()}


def peer_server(system: str, model: str | None, threads: int, parallel: int, ctx_per_slot: int) -> LlamaServer:
    return LlamaServer(model, threads, parallel, ctx_per_slot, peer=PEER_SERVERS[system])


# ---- the client --------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    prompt_tokens: int
    max_tokens: int
    send_t: float = 0.0  # seconds since the run started
    ttft: float = float("nan")
    e2e: float = float("nan")
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (0 if the server does not report it)
    error: str | None = None

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.chunk_times)) if len(self.chunk_times) > 1 else []


async def _one(client, url: str, prompt: list[int], max_tokens: int, rec: RequestRecord, t0: float,
               extra: dict) -> None:
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}
    rec.send_t = time.perf_counter() - t0
    start = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                now = time.perf_counter()
                if msg.get("choices") and msg["choices"][0].get("text"):
                    chunks += 1
                    if not rec.chunk_times:
                        rec.ttft = now - start
                    rec.chunk_times.append(now - start)
                if msg.get("usage"):
                    rec.output_tokens = int(msg["usage"].get("completion_tokens") or 0)
                    rec.cached_tokens = int((msg["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                                            or 0)
        rec.e2e = time.perf_counter() - start
        rec.output_tokens = rec.output_tokens or chunks
    except Exception as e:  # one failed request is a data point, not the end of the run
        rec.error = f"{type(e).__name__}: {e}"


async def _drive(url: str, wl: common.Workload, arrivals: list[float] | None, concurrency: int | None,
                 extra: dict) -> tuple[list[RequestRecord], float]:
    import httpx

    recs = [RequestRecord(len(p), n) for p, n in zip(wl.prompts, wl.output_lens, strict=True)]
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        t0 = time.perf_counter()
        if arrivals is not None:  # open loop: send at the scheduled times, whatever the server's state
            async def timed(i: int) -> None:
                await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
                await _one(client, url, wl.prompts[i], wl.output_lens[i], recs[i], t0, extra)

            await asyncio.gather(*(timed(i) for i in range(len(recs))))
        else:  # closed loop: keep `concurrency` requests in flight
            sem = asyncio.Semaphore(concurrency or len(recs))

            async def limited(i: int) -> None:
                async with sem:
                    await _one(client, url, wl.prompts[i], wl.output_lens[i], recs[i], t0, extra)

            await asyncio.gather(*(limited(i) for i in range(len(recs))))
        elapsed = time.perf_counter() - t0
    errors = [r.error for r in recs if r.error]
    if errors:
        print(f"{len(errors)} requests failed, first: {errors[0]}", file=sys.stderr)
        if len(errors) == len(recs):
            raise RuntimeError(f"every request failed, first: {errors[0]}")
    return recs, elapsed


def run_closed_loop(url: str, wl: common.Workload, concurrency: int, extra: dict | None = None):
    return asyncio.run(_drive(url, wl, None, concurrency, extra or {}))


def run_poisson(url: str, wl: common.Workload, arrivals: list[float], extra: dict | None = None):
    return asyncio.run(_drive(url, wl, arrivals, None, extra or {}))


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


def summarise(recs: list[RequestRecord], elapsed: float) -> dict:
    ok = [r for r in recs if not r.error]
    ttft = [r.ttft for r in ok]
    e2e = [r.e2e for r in ok]
    itl = [x for r in ok for x in r.itls]
    out = sum(r.output_tokens for r in ok)
    return {"completed": len(ok), "failed": len(recs) - len(ok), "elapsed_s": elapsed,
            "req_per_s": len(ok) / elapsed, "out_tok_per_s": out / elapsed,
            "cached_frac": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
            "ttft_p50": common.pct(ttft, 50), "ttft_p99": common.pct(ttft, 99),
            "itl_p50": common.pct(itl, 50), "itl_p99": common.pct(itl, 99),
            "e2e_p50": common.pct(e2e, 50), "e2e_p99": common.pct(e2e, 99)}


# ---- the benchmark -----------------------------------------------------------------------------------
def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p, "16 requests at 2 rates, short outputs, pagedllm only unless --systems")
    # the server as a user starts it: its own dtype choice for this CPU and file (no HF peer here)
    p.set_defaults(dtype="auto")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help="requests per second (default 0.25,0.5,1,2,4)")
    p.add_argument("--num-requests", type=int, default=None, help="requests per rate (default 200)")
    p.add_argument("--max-output", type=int, default=256, help="upper end of the output-length range")
    p.add_argument("--systems", default=None, help=f"comma list of pagedllm and {', '.join(PEER_SERVERS)} (default: "
                                                   "pagedllm and llama-server if found)")
    p.add_argument("--llama-parallel", type=int, default=32, help="llama-server slots")
    p.add_argument("--gguf", default=None, help="GGUF for llama-server (default: the embedded model)")
    p.add_argument("--server-args", default="", help="extra `pagedllm serve` arguments, space separated")
    serving_dp.add_args(p)
    serving_sweep.add_args(p)


def _systems(args: argparse.Namespace) -> list[str]:
    if args.systems:
        return args.systems.split(",")
    found = ["pagedllm"]
    if common.LLAMA_CPP.tool("llama-server") and not args.quick:
        found.append("llama-server")
    return found


def measure(args: argparse.Namespace) -> dict:
    common.set_threads(args.threads)
    if args.concurrency:
        payload = serving_sweep.sweep(args, PagedllmServer, peer_server, _systems(args), run_closed_loop, summarise)
        jp, _ = common.save("serving-sweep" + args.tag, payload, None, args.out_dir)
        print(f"wrote {jp}")
        return payload
    rates = args.rates or ([1.0, 4.0] if args.quick else [0.25, 0.5, 1.0, 2.0, 4.0])
    n = args.num_requests or (12 if args.quick else 200)
    max_out = min(args.max_output, 32) if args.quick else args.max_output
    dp = (args.data_parallel_size or 1) > 1
    if dp:
        workloads = serving_dp.workloads(args, rates, n, max_out)
    else:
        workloads = {rate: common.offline_workload(n, output_len=(min(16, max_out), max_out),
                                                   seed=args.seed + 1000 * (i + 1), model_path=args.model)
                     for i, rate in enumerate(rates)}
    arrivals = {rate: poisson_arrivals(n, rate, args.seed + i) for i, rate in enumerate(rates)}
    results: dict[str, list[dict]] = {}
    records: dict[str, dict[float, list[RequestRecord]]] = {}
    servers = serving_dp.systems(args, PagedllmServer) if dp else [(s, None) for s in _systems(args)]
    for system, srv in servers:
        if srv is not None:
            pass
        elif system == "pagedllm":
            srv = PagedllmServer(args.model, args.dtype, args.threads,
                                 ["--quantization", args.quantization, *args.server_args.split()])
        elif system in PEER_SERVERS:
            ctx = max(len(p) + m for w in workloads.values() for p, m in zip(w.prompts, w.output_lens,
                                                                          strict=True)) + 16
            srv = peer_server(system, args.gguf, args.threads, args.llama_parallel, ctx)
        else:
            raise ValueError(f"unknown serving system {system!r}")
        with srv:
            run_closed_loop(srv.url, workloads[rates[0]].head(2), 2, srv.extra_body)  # warm-up
            for rate in rates:
                reps = []
                for _ in range(args.repeats):
                    recs, elapsed = run_poisson(srv.url, workloads[rate], arrivals[rate], srv.extra_body)
                    reps.append((summarise(recs, elapsed), recs))
                reps.sort(key=lambda r: r[0]["ttft_p50"])
                summ, recs = reps[len(reps) // 2]
                summ.update(system=system, rate=rate)
                results.setdefault(system, []).append(summ)
                records.setdefault(system, {})[rate] = recs
                print(f"{system} @ {rate} req/s: TTFT p50 {summ['ttft_p50']:.2f}s p99 {summ['ttft_p99']:.2f}s, "
                      f"{summ['out_tok_per_s']:.1f} out tok/s", file=sys.stderr, flush=True)
            rss = srv.peak_rss_mb()
        for s in results[system]:
            s["server_peak_rss_mb"] = rss
    knee = {s: next((r["rate"] for r in rows if not r["ttft_p99"] <= TTFT_SLO_S), None)
            for s, rows in results.items()}
    cols = ["system", "rate", "completed", "req_per_s", "out_tok_per_s", "ttft_p50", "ttft_p99", "itl_p50",
            "itl_p99", "e2e_p50", "e2e_p99", "cached_frac"]
    rows = [r for rs in results.values() for r in rs]
    print(common.table(rows, cols, title=f"serving: {n} requests per rate, Poisson arrivals (times in s)"))
    for s, k in knee.items():
        print(f"{s}: p99 TTFT passes {TTFT_SLO_S:g}s at " + (f"{k:g} req/s" if k else "none of the rates"))
    payload = {"bench": "serving", "env": common.environment(args.threads), "num_requests": n, "rates": rates,
               "workloads": {str(r): w.summary() for r, w in workloads.items()}, "results": results,
               "p99_ttft_over_2s_at_rate": knee,
               "ttft_samples": {s: {str(r): [x.ttft for x in recs] for r, recs in d.items()}
                                for s, d in records.items()}}
    fig = _plot(results, records)
    jp, pp = common.save("serving" + args.tag, payload, fig, args.out_dir)
    print(f"wrote {jp}" + (f" and {pp}" if pp else ""))
    return payload


def _plot(results: dict, records: dict):
    plt = common.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for system, rows in results.items():
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["ttft_p50"] for r in rows], "o-", label=f"{system} p50")
        axes[0].plot(rates, [r["ttft_p99"] for r in rows], "s--", label=f"{system} p99")
        axes[1].plot(rates, [r["out_tok_per_s"] for r in rows], "o-", label=system)
        for rate, recs in records[system].items():
            e2e = np.sort([r.e2e for r in recs if not r.error])
            if len(e2e):
                axes[2].plot(e2e, np.arange(1, len(e2e) + 1) / len(e2e), label=f"{system} @{rate:g}/s")
    axes[0].axhline(TTFT_SLO_S, color="grey", lw=0.8, ls=":")
    axes[0].set(xlabel="arrival rate (req/s)", ylabel="TTFT (s)", title="time to first token", yscale="log")
    axes[1].set(xlabel="arrival rate (req/s)", ylabel="output tokens/s", title="throughput")
    axes[2].set(xlabel="end-to-end latency (s)", ylabel="fraction of requests", title="latency CDF")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return fig


run = measure  # what `pagedllm bench` calls
