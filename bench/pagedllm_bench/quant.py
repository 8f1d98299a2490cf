"""The quantized GEMM per GGUF type against the machine's limits: `pagedllm bench quant [--types Q4_K,Q6_K]`.

For each type, weights in the packed form the engine runs (random, well-formed blocks):
- decode: one activation row against an N x K matrix far larger than the last-level cache; weight GB/s against
  the measured read bandwidth (`bench membw`);
- prefill / batches: M rows against a cache-sized matrix; GOP/s (2 M N K per call) against the measured int8 peak.
With --unpacked, the same matrices on the file's blocks as stored (the kernel a matrix whose rows do not fill
16-row groups runs on) in the same process: the packed form's speed-up.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pagedllm.quantization.types import BY_NAME, KERNEL_TYPES
from pagedllm_bench import common
from pagedllm_bench.membw import limits


def _weights(name: str, rows: int, cols: int, packed: bool = True):
    from pagedllm.quantization.tensor import QuantTensor, type_id
    from pagedllm.testing.gguf_writer import quantized

    tile = quantized(np.random.default_rng(0), min(rows, 1024), cols, name, 0.02)
    reps = -(-rows // tile.shape[0])  # whole tiles, then cut to `rows`
    raw = np.ascontiguousarray(np.tile(tile, (reps, 1))[:rows])
    w = QuantTensor(torch.from_numpy(raw), type_id(name), cols)
    return w.packed() if packed else w


def _best(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _times(name: str, decode_shape: tuple[int, int], prefill_shape: tuple[int, int], rows: int, repeats: int,
           packed: bool) -> tuple[float, float]:
    (n, k), (n2, k2) = decode_shape, prefill_shape
    w = _weights(name, n, k, packed)
    x1 = torch.randn(1, k)
    t1 = _best(lambda: w.matmul(x1), repeats)
    w2 = _weights(name, n2, k2, packed)
    xm = torch.randn(rows, k2)
    return t1, _best(lambda: w2.matmul(xm), repeats)


def measure(name: str, decode_shape: tuple[int, int], prefill_shape: tuple[int, int], rows: int,
            repeats: int, unpacked: bool = False) -> dict:
    (n, k), (n2, k2) = decode_shape, prefill_shape
    t1, tm = _times(name, decode_shape, prefill_shape, rows, repeats, True)
    res = {"type": name, "decode_gb_s": n * BY_NAME[name].row_bytes(k) / t1 / 1e9, "decode_ms": t1 * 1e3,
           f"gemm{rows}_gops": 2 * rows * n2 * k2 / tm / 1e9}
    if unpacked:
        u1, um = _times(name, decode_shape, prefill_shape, rows, repeats, False)
        res["decode_x_unpacked"], res[f"gemm{rows}_x_unpacked"] = u1 / t1, um / tm
    return res


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--types", default=",".join(t.name for t in KERNEL_TYPES))
    p.add_argument("--decode-shape", default="65536,2048", help="N,K of the one-row product (past the cache)")
    p.add_argument("--prefill-shape", default="4096,2048", help="N,K of the many-row product")
    p.add_argument("--rows", type=int, default=64, help="activation rows of the many-row product")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    p.add_argument("--unpacked", action="store_true", help="also time the file's blocks as stored (speed-up)")
    p.add_argument("--quick", action="store_true", help="three types, two repeats (checks the command runs)")


def run(args: argparse.Namespace) -> dict:
    if args.quick:
        args.types, args.repeats = "Q4_0,Q4_K,Q6_K", 2
    common.set_threads(args.threads)
    lim = limits(args.threads)
    shape = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    rows = []
    for name in args.types.split(","):
        r = measure(name, shape(args.decode_shape), shape(args.prefill_shape), args.rows, args.repeats,
                    args.unpacked)
        r["decode_of_read_bw"] = r["decode_gb_s"] / lim["read_gb_s"]
        if lim["int8_peak_gops"]:
            r[f"gemm{args.rows}_of_int8_peak"] = r[f"gemm{args.rows}_gops"] / lim["int8_peak_gops"]
        if lim.get("amx_int8_peak_gops"):
            r[f"gemm{args.rows}_of_amx_peak"] = r[f"gemm{args.rows}_gops"] / lim["amx_int8_peak_gops"]
        rows.append(r)
        print(r, flush=True)
    title = (f"quantized GEMM, {args.threads} threads: read {lim['read_gb_s']:.1f} GB/s, int8 peak "
             f"{lim['int8_peak_gops']:.0f} GOP/s ({common.environment()['cpu']})")
    print(common.table(rows, title=title))
    payload = {"limits": lim, "rows": rows, "env": common.environment(args.threads)}
    common.save("quant", payload)
    return payload
