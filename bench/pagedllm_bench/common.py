"""Shared benchmark plumbing: seeded workloads, thread pinning, step-driven engine runs, the environment record,
tables, and the JSON + PNG writers (everything lands in bench_results/, which git ignores)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RESULTS_DIR = os.environ.get("PAGEDLLM_BENCH_DIR", "bench_results")
DEFAULT_THREADS = 2


# ---- workloads ---------------------------------------------------------------------------------------
@dataclass
class Workload:
    """Token-id prompts and the exact number of tokens to generate for each (ignore_eos everywhere)."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, n: int) -> Workload:
        return Workload(self.name, self.prompts[:n], self.output_lens[:n], self.seed, dict(self.meta))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Workload:
        return cls(**d)

    def summary(self) -> dict:
        pl = [len(p) for p in self.prompts]
        return {"name": self.name, "num_requests": len(self.prompts), "seed": self.seed,
                "prompt_tokens": sum(pl), "output_tokens": sum(self.output_lens),
                "prompt_len_range": [min(pl), max(pl)] if pl else None,
                "output_len_range": [min(self.output_lens), max(self.output_lens)] if pl else None, **self.meta}


def default_model_path() -> str:
    from pagedllm.model.loader import default_model_path as _default

    return _default()


def normal_token_ids(model_path: str | None = None) -> np.ndarray:
    """Ids of ordinary vocabulary tokens (no special/added/control tokens), from the model's own tokenizer."""
    from pagedllm.model.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path or default_model_path())
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    vocab = len(tok)
    return np.array([i for i in range(vocab) if i not in special], dtype=np.int64)


def random_prompts(rng: np.random.Generator, ids: np.ndarray, lens: Sequence[int]) -> list[list[int]]:
    return [rng.choice(ids, size=int(n)).tolist() for n in lens]


def offline_workload(num_requests: int = 256, prompt_len: tuple[int, int] = (32, 512),
                     output_len: tuple[int, int] = (16, 256), seed: int = 0,
                     model_path: str | None = None) -> Workload:
    """DESIGN.md 'offline': prompts U[32,512], outputs U[16,256] (inclusive), seeded synthetic token ids."""
    rng = np.random.default_rng(seed)
    ids = normal_token_ids(model_path)
    plens = rng.integers(prompt_len[0], prompt_len[1] + 1, size=num_requests)
    olens = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    return Workload("offline", random_prompts(rng, ids, plens), [int(x) for x in olens], seed,
                    {"prompt_len": list(prompt_len), "output_len": list(output_len)})


# ---- environment -------------------------------------------------------------------------------------
def set_threads(n: int = DEFAULT_THREADS) -> None:
    """Pin torch (and any child process) to n threads."""
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    import torch

    torch.set_num_threads(n)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + ("-dirty" if dirty else "") if rev else None
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass(frozen=True)
class LlamaPeer:
    """A llama.cpp-family engine the benches drive through its own llama-server and tools. `make bench-setup`
    builds each next to the venv's python, ik_llama.cpp's with an `ik-` prefix (IK_LLAMA_SRC=path)."""

    name: str
    server: str  # its llama-server's name in results, and the serving bench's system name
    prefix: str  # of its binaries' names
    server_args: tuple[str, ...]  # every llama-server run of it passes these
    # whether /completion must stream: ik_llama.cpp answers a whole completion whose text ends inside a UTF-8
    # character (random weights often do) with HTTP 500; its stream replaces the bytes instead
    stream_completions: bool = False

    def tool(self, name: str) -> str | None:
        """Its `name` binary (llama-server, llama-perplexity, ...): the bench build's, else (llama.cpp) one on PATH."""
        cand = os.path.join(os.path.dirname(sys.executable), self.prefix + name)
        if os.access(cand, os.X_OK):
            return cand
        return None if self.prefix else shutil.which(name)

    def version(self) -> str | None:
        """The commit its build recorded, else what its llama-server --version prints."""
        commit = os.path.join(os.path.dirname(sys.executable), self.prefix + "llama.commit")
        if os.path.exists(commit):
            with open(commit, encoding="utf-8") as f:
                return f.read().strip()
        exe = self.tool("llama-server")
        if not exe:
            return None
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20)
            text = (out.stdout + out.stderr).strip().splitlines()
            return next((t for t in text if t.startswith("version")), text[0] if text else None)
        except (OSError, subprocess.SubprocessError):
            return None


LLAMA_CPP = LlamaPeer("llama.cpp", "llama-server", "", ("--no-webui",))
# ik_llama.cpp with its run-time repack (-rtr: weights re-laid for its GEMMs at load) and without: its best differs
# by file and phase, so the benches take both (its flash attention and fused MoE are on by default).
IK_LLAMA = LlamaPeer("ik_llama.cpp", "ik-llama-server", "ik-", ("--webui", "none", "--log-disable"),  # (no llama.log)
                     True)
IK_LLAMA_RTR = LlamaPeer("ik_llama.cpp-rtr", "ik-llama-server-rtr", "ik-", (*IK_LLAMA.server_args, "-rtr"), True)
LLAMA_PEERS = {p.name: p for p in (LLAMA_CPP, IK_LLAMA, IK_LLAMA_RTR)}


def environment(threads: int = DEFAULT_THREADS) -> dict:
    import torch

    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        mem_gb = None
    return {
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["pagedllm", "bench", *sys.argv[1:]]) if "bench" not in sys.argv else
        " ".join(["pagedllm", *sys.argv[sys.argv.index("bench"):]]),
        "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "mem_gb": round(mem_gb, 1) if mem_gb else None,
        "threads": threads, "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
        "python": platform.python_version(), "git": _git_commit(),
        "versions": {d: _version(d) for d in ("pagedllm", "torch", "transformers", "numpy", "llama_cpp_python",
                                               "matplotlib", "gguf")},
        "peers": {p.name: p.version() for p in (LLAMA_CPP, IK_LLAMA) if p.tool("llama-server")},
    }


def peak_rss_mb(pid: int | str = "self") -> float:
    """A process's peak resident set size. Linux: VmHWM, the high-water mark of its program's memory. Not
    ru_maxrss, which survives exec: a worker started by a bench driver reported the driver's peak (its tokenizer
    and bandwidth buffer) whenever that was higher than its own."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if pid == "self" else float("nan")


def rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        return float("nan")


# ---- engine driving ----------------------------------------------------------------------------------
@dataclass
class StepSample:
    t: float
    running: int
    waiting: int
    used_slots: int
    allocated_slots: int
    used_blocks: int


@dataclass
class DriveResult:
    elapsed: float
    samples: list[StepSample]
    first_token_time: dict[str, float]  # request id -> seconds from submission to first output token
    finish_time: dict[str, float]
    outputs: dict[str, Any]


def drive(engine, requests: Sequence[tuple[str, list[int], Any]], sample: bool = True,
          on_step: Callable[[], None] | None = None) -> DriveResult:
    """Submit all requests at once, then step the engine until done, sampling the scheduler and the KV cache
    after every step (the samples are cheap Python reads; the model dominates each step)."""
    t0 = time.perf_counter()
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    kv, sched = engine.kv, engine.scheduler
    samples: list[StepSample] = []
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    outputs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - t0
        for o in outs:
            if o.request_id not in first and any(c.token_ids for c in o.outputs):
                first[o.request_id] = now
            if o.finished:
                done[o.request_id] = now
                outputs[o.request_id] = o
        if sample:
            s = kv.stats()
            samples.append(StepSample(now, len(sched.running), len(sched.waiting), s["used_slots"],
                                      s["allocated_slots"], s["num_blocks"] - s["num_free_blocks"]))
        if on_step is not None:
            on_step()
    return DriveResult(time.perf_counter() - t0, samples, first, done, outputs)


def warm_up(llm, n: int = 2) -> None:
    """One short batch so that one-off costs (kernel build/load, allocator growth) stay out of the timings."""
    from pagedllm.sampling_params import SamplingParams

    llm.generate([[100 + i for i in range(40)]] * n, SamplingParams(max_tokens=4, ignore_eos=True,
                                                                   temperature=0.0), use_tqdm=False)
    llm.engine.kv.reset_prefix_cache()


def reset_peak(llm) -> None:
    """Start a fresh peak-blocks measurement (the manager keeps a running maximum)."""
    llm.engine.reset_stats()


# ---- statistics and output -----------------------------------------------------------------------------
def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}" if abs(v) >= 0.01 or v == 0 else f"{v:.2g}"
    return "-" if v is None else str(v)


def table(rows: Sequence[dict], columns: Sequence[str] | None = None, title: str | None = None) -> str:
    """A GitHub-markdown table (prints fine on a terminal too)."""
    if not rows:
        return ""
    cols = list(columns or rows[0].keys())
    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = [] if title is None else [f"\n{title}"]
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        lines.append("| " + " | ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) + " |")
    return "\n".join(lines)


def out_path(name: str, ext: str, out_dir: str | None = None) -> str:
    d = out_dir or RESULTS_DIR
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, f"{name}.{ext}")


def save(name: str, payload: dict, fig=None, out_dir: str | None = None) -> tuple[str, str | None]:
    """Write bench_results/<name>.json (and .png when a figure is given); returns the paths."""
    jp = out_path(name, "json", out_dir)
    with open(jp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, default=_json_default)
    pp = None
    if fig is not None:
        pp = out_path(name, "png", out_dir)
        fig.savefig(pp, dpi=110, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(fig)
    return jp, pp


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def pyplot():
    """matplotlib with the Agg backend (no display here); None if matplotlib is missing (`make bench-setup`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (run `make bench-setup`)", file=sys.stderr)
        return None
    return plt


def add_common_args(p: argparse.ArgumentParser, quick_help: str = "a small run (< 60 s) for smoke tests") -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2-135M GGUF)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])  # (the HF peers take it too)
    add_quantization_arg(p)
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="repeat each measured run; medians are reported")
    p.add_argument("--out-dir", default=None, help=f"where JSON and PNG go (default {RESULTS_DIR}/)")
    p.add_argument("--tag", default="", help="suffix for the output file names")
    p.add_argument("--quick", action="store_true", help=quick_help)


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    # The engine's default runs GGUF weights as stored; these benches compare against peers that dequantize them
    # (transformers) and their published figures are of the dequantized engine, so they default to "none".
    p.add_argument("--quantization", default="none", choices=["auto", "none", "int8"],
                   help="how pagedllm runs the weights (default none: dequantized, as the peers and BENCHMARKS.md)")


def int_range(text: str) -> tuple[int, int]:
    """'32,512' -> (32, 512): an inclusive length range."""
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def llm_kwargs(args: argparse.Namespace, **overrides) -> dict:
    kw = {"model": args.model, "dtype": args.dtype, "seed": args.seed, "quantization": args.quantization}
    kw.update(overrides)
    return kw

