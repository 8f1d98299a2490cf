"""Paged attention kernel vs gather-then-SDPA vs contiguous SDPA (decode), and vs SDPA causal (prefill).

`pagedllm bench kernel [--quick]`. Default shape: 32 requests x 1024
tokens, 9 query / 3 KV heads, head_dim 64, block size 16, blocks scattered over the pool at random. All methods see
the same K/V values; methods are interleaved round by round and medians reported (the machine is shared/noisy).
The paged kernel is also timed over the same K/V stored in the other KV dtypes (--kv-dtypes: fp32, bf16, int8 rows
with their scales), against contiguous SDPA over the values that storage holds. --flex also times the "flex"
backend's decode, compiled.

`--device cuda`: the GPU backends instead (kernel_device.py): triton, flex and SDPA over contiguous KV, for decode
at a few batch sizes and context lengths and a prefill chunk against cached blocks (defaults there: bf16, 32/8
heads, head_dim 128).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.attention.kv_quant import as_float, is_int8, quantize, round_queries
from pagedllm.attention.metadata import build_attention_metadata

# per device: (dtype, query heads, KV heads, head_dim) unless given
DEVICE_DEFAULTS = {"cpu": ("float32", 9, 3, 64), "cuda": ("bfloat16", 32, 8, 128)}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: the C++ kernel's comparisons; cuda: triton vs flex vs contiguous SDPA")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--num-heads", type=int, default=None, help="default 9 (cpu), 32 (cuda)")
    p.add_argument("--num-kv-heads", type=int, default=None, help="default 3 (cpu), 8 (cuda)")
    p.add_argument("--head-dim", type=int, default=None, help="default 64 (cpu), 128 (cuda)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default float32 (cpu), "
                   "bfloat16 (cuda)")
    p.add_argument("--kv-dtypes", default="float32,bfloat16,int8",
                   help="KV storages the paged kernel is also timed with (q stays --dtype); '' for none")
    p.add_argument("--repeats", type=int, default=30, help="decode rounds (prefill uses a fifth, at least 3)")
    p.add_argument("--prefill-requests", type=int, default=None,
                   help="requests in the prefill comparison (default: --num-requests)")
    p.add_argument("--no-prefill", action="store_true", help="decode only (long contexts: prefill is quadratic)")
    p.add_argument("--flex", action="store_true", help="also time the flex backend's decode, compiled (slow first "
                   "compile)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="few repeats, 8 prefill requests")
    p.add_argument("--bandwidth-mib", type=int, default=256, help="buffer size of the bandwidth measurement")
    p.add_argument("--json", default=None, help="also write the results to this file")


def _time_rounds(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 2,
                 stat: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
    """Seconds per call (median by default); the methods take turns within each round so drift hits them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: stat(v) for k, v in times.items()}


def measure_bandwidth(nbytes: int = 256 << 20, rounds: int = 7) -> float:
    """Read bandwidth in GB/s: sum over a large buffer with all threads (best round: others share the machine)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    t = _time_rounds({"sum": lambda: x.sum()}, rounds, stat=min)["sum"]
    return nbytes / t / 1e9


def build_pool(num_requests: int, ctx: int, hkv: int, d: int, block_size: int, dtype: torch.dtype,
               gen: torch.Generator):
    """A pool holding every request's context in scattered blocks, plus the same K/V laid out contiguously."""
    nb = -(-ctx // block_size)
    num_blocks = num_requests * nb + 8
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[:num_requests * nb].view(num_requests, nb)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    # contiguous copy of the same values, [R, Hkv, L, D] (the layout SDPA prefers)
    k_contig = k_cache[tables].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    v_contig = v_cache[tables].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    return k_cache, v_cache, tables, k_contig, v_contig


def gather_sdpa_decode(q4: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                       ctx: int, scale: float) -> torch.Tensor:
    """What a kernel-less backend does: copy each request's blocks out, then SDPA."""
    k = k_cache[tables].flatten(1, 2)[:, :ctx].transpose(1, 2)
    v = v_cache[tables].flatten(1, 2)[:, :ctx].transpose(1, 2)
    return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)


def run(args: argparse.Namespace) -> None:
    """Print the tables (and write --json); `pagedllm bench kernel` calls this."""
    resolve_device_defaults(args)
    if args.device == "cuda":
        from pagedllm_bench import kernel_device

        results = kernel_device.run(args)
    else:
        results = measure(args)
        _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def resolve_device_defaults(args: argparse.Namespace) -> None:
    """Fill the options left unset with the device's defaults."""
    dtype, hq, hkv, d = DEVICE_DEFAULTS[getattr(args, "device", "cpu")]
    for name, value in (("dtype", dtype), ("num_heads", hq), ("num_kv_heads", hkv), ("head_dim", d)):
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def measure(args: argparse.Namespace) -> dict:
    from pagedllm import kernels

    resolve_device_defaults(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.repeats = min(args.repeats, 10)
        args.prefill_requests = args.prefill_requests or 8
    dtype = getattr(torch, args.dtype)
    r, ctx, hq, hkv, d, bs = (args.num_requests, args.context_len, args.num_heads, args.num_kv_heads,
                              args.head_dim, args.block_size)
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(0)
    kernels.load_ops()
    k_cache, v_cache, tables, k_contig, v_contig = build_pool(r, ctx, hkv, d, bs, dtype, gen)
    tlist = tables.tolist()
    esz = k_cache.element_size()
    kv_bytes = 2 * r * ctx * hkv * d * esz
    results: dict = {"shape": dict(requests=r, context=ctx, hq=hq, hkv=hkv, head_dim=d, block_size=bs,
                                   dtype=args.dtype), "threads": torch.get_num_threads(),
                     "variant": kernels.build_variant()[0]}
    results["bandwidth_gbs"] = measure_bandwidth(args.bandwidth_mib << 20)

    # ---- decode: one new query per request, the whole context cached
    meta = build_attention_metadata(tlist, [ctx - 1] * r, [1] * r, bs)
    q = torch.randn(r, hq, d, generator=gen).to(dtype)
    q4 = q[:, :, None, :]
    out = torch.empty_like(q)
    kv_pools = _kv_storages(args, k_cache, v_cache)
    fns = {
        "paged kernel": lambda: kernels.paged_attention(q, k_cache, v_cache, meta, scale, out=out),
        **{f"paged kernel, {name} KV": _paged(q, kc, vc, meta, scale) for name, (kc, vc) in kv_pools.items()},
        "gather + SDPA": lambda: gather_sdpa_decode(q4, k_cache, v_cache, tables, ctx, scale),
        "contiguous SDPA": lambda: F.scaled_dot_product_attention(q4, k_contig, v_contig, scale=scale,
                                                                  enable_gqa=True),
    }
    if args.flex:
        from pagedllm.attention.flex_paged import FlexAttentionBackend

        flex = FlexAttentionBackend(compile=True)
        # the new token's K/V: the values already in its slot (the write changes nothing)
        k_new, v_new = (c.view(-1, hkv, d)[meta.slot_mapping].clone() for c in (k_cache, v_cache))
        fns["flex (compiled)"] = lambda: flex.forward(q, k_new, v_new, k_cache, v_cache, meta, scale)
    ref = fns["contiguous SDPA"]()[:, :, 0].float()
    for name, fn in fns.items():  # every method computes the same thing (over the values its storage holds)
        got = fn()
        got = got[:, :, 0] if got.dim() == 4 else got
        kv = kv_pools.get(name.removeprefix("paged kernel, ").removesuffix(" KV"))
        want = ref if kv is None else _contiguous_sdpa(q4, *kv, tables, ctx, scale)[:, :, 0].float()
        err = (got.float() - want).abs().max().item()
        # int8 KV: the kernel also rounds each chunk's probabilities to 15 bits (attention_dot_int8.cpp)
        limit = 3e-2 if dtype != torch.float32 else 5e-4 if kv is not None and is_int8(kv[0]) else 1e-4
        assert err < limit, f"{name} disagrees with SDPA: {err}"
    dec = _time_rounds(fns, args.repeats)
    dec_min = _time_rounds(fns, max(3, args.repeats // 3), warmup=0, stat=min)
    moved = {"paged kernel": kv_bytes, "gather + SDPA": 3 * kv_bytes, "contiguous SDPA": kv_bytes,
             "flex (compiled)": kv_bytes,
             **{f"paged kernel, {name} KV": 2 * r * ctx * hkv * kc.shape[-1] * kc.element_size()
                for name, (kc, _) in kv_pools.items()}}
    results["decode"] = {name: {"ms": t * 1e3, "vs_contiguous": t / dec["contiguous SDPA"],
                                "min_ms": dec_min[name] * 1e3, "bytes_mb": moved[name] / 1e6,
                                "floor_ms": moved[name] / (results["bandwidth_gbs"] * 1e9) * 1e3,
                                "gbs_at_min": moved[name] / dec_min[name] / 1e9}
                         for name, t in dec.items()}

    if args.no_prefill:
        return results
    # ---- prefill: every request's context is new (causal), compared with SDPA is_causal on contiguous K/V
    rp = min(args.prefill_requests or r, r)
    meta_p = build_attention_metadata(tlist[:rp], [0] * rp, [ctx] * rp, bs)
    qp = torch.randn(rp * ctx, hq, d, generator=gen).to(dtype)
    qp4 = qp.view(rp, ctx, hq, d).transpose(1, 2)
    outp = torch.empty_like(qp)
    pf = {
        "paged kernel": lambda: kernels.paged_attention(qp, k_cache, v_cache, meta_p, scale, out=outp),
        **{f"paged kernel, {name} KV": _paged(qp, kc, vc, meta_p, scale) for name, (kc, vc) in kv_pools.items()},
        "SDPA causal": lambda: F.scaled_dot_product_attention(qp4, k_contig[:rp], v_contig[:rp], is_causal=True,
                                                              scale=scale, enable_gqa=True),
    }
    err = (pf["paged kernel"]().view(rp, ctx, hq, d).transpose(1, 2).float() - pf["SDPA causal"]().float())
    assert err.abs().max().item() < (1e-4 if dtype == torch.float32 else 3e-2), "prefill disagrees with SDPA"
    pre = _time_rounds(pf, max(3, args.repeats // 5), warmup=1)
    flops = 4 * rp * hq * d * ctx * (ctx + 1) / 2  # QK^T and PV over the causal triangle
    results["prefill"] = {name: {"ms": t * 1e3, "vs_sdpa": t / pre["SDPA causal"], "gflops": flops / t / 1e9}
                          for name, t in pre.items()}
    results["prefill_requests"] = rp
    return results


def _kv_storages(args: argparse.Namespace, k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict:
    """name -> (k_cache, v_cache): the same K/V in each storage of --kv-dtypes (int8: quantized rows)."""
    pools = {}
    for name in filter(None, args.kv_dtypes.split(",")):
        if name == "int8":
            pools[name] = (quantize(k_cache), quantize(v_cache))
        else:
            pools[name] = (k_cache.to(getattr(torch, name)), v_cache.to(getattr(torch, name)))
    return pools


def _paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float) -> Callable:
    from pagedllm import kernels

    out = torch.empty_like(q)
    return lambda: kernels.paged_attention(q, k_cache, v_cache, meta, scale, out=out)


def _contiguous_sdpa(q4: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, ctx: int,
                     scale: float) -> torch.Tensor:
    """SDPA in fp32 over the values a pool holds (dequantized for int8, with q rounded as the kernel rounds it
    there), laid out contiguously."""
    from pagedllm import kernels

    if is_int8(k_cache) and kernels.rounds_int8_queries(q4.shape[-1]):
        q4 = round_queries(q4, scale)
    k = as_float(k_cache[tables].flatten(1, 2)[:, :ctx], torch.float32).transpose(1, 2)
    v = as_float(v_cache[tables].flatten(1, 2)[:, :ctx], torch.float32).transpose(1, 2)
    return F.scaled_dot_product_attention(q4.float(), k, v, scale=scale, enable_gqa=True)


def _print(res: dict) -> None:
    s = res["shape"]
    print(f"# kernel bench: {s['requests']} req x {s['context']} tok, {s['hq']}/{s['hkv']} heads, "
          f"head_dim {s['head_dim']}, block {s['block_size']}, {s['dtype']}, {res['threads']} threads, "
          f"build {res['variant']}; torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print(f"measured read bandwidth (best of 7): {res['bandwidth_gbs']:.1f} GB/s\n")
    print("| decode (1 query/request) | median ms | vs contiguous SDPA | min ms | MB moved | "
          "floor ms at measured BW | GB/s at min |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, v in res["decode"].items():
        print(f"| {name} | {v['ms']:.3f} | {v['vs_contiguous']:.2f}x | {v['min_ms']:.3f} | {v['bytes_mb']:.1f} | "
              f"{v['floor_ms']:.2f} | {v['gbs_at_min']:.1f} |")
    dec = res["decode"]
    print(f"\ngather + SDPA / paged kernel: {dec['gather + SDPA']['ms'] / dec['paged kernel']['ms']:.2f}x")
    int8 = "paged kernel, int8 KV"
    for n in [n for n in dec if n.startswith("paged kernel, ") and n != int8 and int8 in dec]:
        pre = res.get("prefill")
        print(f"decode {n.removeprefix('paged kernel, ')} / int8 KV: {dec[n]['ms'] / dec[int8]['ms']:.2f}x"
              + (f" (prefill {pre[n]['ms'] / pre[int8]['ms']:.2f}x)" if pre else ""))
    if "prefill" not in res:
        return
    print(f"\n| prefill ({res['prefill_requests']} req x {s['context']} new tokens, causal) | median ms | "
          f"vs SDPA causal | GFLOP/s |")
    print("|---|---:|---:|---:|")
    for name, v in res["prefill"].items():
        print(f"| {name} | {v['ms']:.1f} | {v['vs_sdpa']:.2f}x | {v['gflops']:.1f} |")
