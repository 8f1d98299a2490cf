"""`pagedllm bench kernel --device cuda`: the device's paged-attention backends against SDPA over contiguous KV.

Methods: the "triton" backend (skipped with a note when it is not there), the "flex" backend (compiled
FlexAttention, its block mask built once per step and reused by the layers: timed apart), and torch SDPA over the
same K/V laid out contiguously per request (the no-paging baseline: a paged engine does not have that tensor).
Cases: decode (one query per request) at a few batch sizes and context lengths, and a prefill chunk against cached
blocks (SDPA with the offset causal mask as a boolean mask). Every method is checked against fp32 SDPA first;
the first calls (compiles) are not timed. Prints per case each method's time, the bandwidth (decode) or FLOP rate
(prefill) it reached, the fastest, and why in a line.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.attention import get_backend
from pagedllm.attention.flex_paged import FlexAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata, build_attention_metadata

# (requests, context) decode cases, and (requests, cached, chunk) for the prefill chunk
DECODE_CASES = [(1, 8192), (16, 2048), (64, 4096), (256, 1024)]
PREFILL_CASES = [(4, 2048, 512)]
QUICK_DECODE_CASES = [(4, 512), (32, 1024)]
QUICK_PREFILL_CASES = [(2, 256, 128)]


def run(args: argparse.Namespace) -> dict:
    """Measure and print; `pagedllm bench kernel --device cuda` calls this."""
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("pagedllm bench kernel --device cuda: torch sees no CUDA device here")
    res = compare(args)
    _print(res)
    return res


def compare(args: argparse.Namespace, decode_cases: list[tuple[int, int]] | None = None,
            prefill_cases: list[tuple[int, int, int]] | None = None, flex_compile: bool | None = None) -> dict:
    """All cases on args.device (flex_compile: the flex backend's compile option, None: its default)."""
    device = torch.device(args.device)
    quick = getattr(args, "quick", False)
    decode_cases = decode_cases or (QUICK_DECODE_CASES if quick else DECODE_CASES)
    prefill_cases = prefill_cases if prefill_cases is not None else (QUICK_PREFILL_CASES if quick else PREFILL_CASES)
    dtype = getattr(torch, args.dtype)
    hq, hkv, d, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    rounds = max(1, min(args.repeats, 10) if quick else args.repeats)
    methods: dict[str, object] = {}
    notes = []
    try:
        methods["triton"] = get_backend("triton", device)
    except Exception as e:  # not registered (written in parallel), or no Triton here
        notes.append(f"triton backend skipped: {e}")
    methods["flex"] = FlexAttentionBackend(compile=flex_compile)
    res: dict = {"device": str(device), "name": _device_name(device), "dtype": args.dtype,
                 "heads": (hq, hkv, d), "block_size": bs, "notes": notes, "cases": []}
    gen = torch.Generator(device).manual_seed(0)
    for r, ctx in decode_cases:
        res["cases"].append(_case(methods, device, dtype, gen, r, ctx - 1, 1, hq, hkv, d, bs, rounds))
    for r, cached, chunk in prefill_cases:
        res["cases"].append(_case(methods, device, dtype, gen, r, cached, chunk, hq, hkv, d, bs, max(1, rounds // 3)))
    return res


def _case(methods: dict, device: torch.device, dtype: torch.dtype, gen: torch.Generator, r: int, cached: int,
          new: int, hq: int, hkv: int, d: int, bs: int, rounds: int) -> dict:
    ctx = cached + new
    nb = -(-ctx // bs)
    num_blocks = r * nb + 8
    tables = torch.randperm(num_blocks, generator=gen, device=device)[:r * nb].view(r, nb)
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen, device=device).to(dtype)
    meta = _to(build_attention_metadata(tables.tolist(), [cached] * r, [new] * r, bs), device)
    # the new tokens' K/V are the values already in their slots: every method sees the same K/V
    k_new = k_cache.view(-1, hkv, d)[meta.slot_mapping].clone()
    v_new = v_cache.view(-1, hkv, d)[meta.slot_mapping].clone()
    q = torch.randn(r * new, hq, d, generator=gen, device=device).to(dtype)
    kc = k_cache[tables].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()  # [R, Hkv, ctx, D]
    vc = v_cache[tables].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    q4 = q.view(r, new, hq, d).transpose(1, 2)
    mask = None if new == 1 else torch.ones(new, ctx, dtype=torch.bool, device=device).tril(cached)
    scale = d ** -0.5

    def sdpa(qq=q4, kk=kc, vv=vc):
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)

    fns: dict[str, Callable[[], torch.Tensor]] = {
        name: (lambda b=b: b.forward(q, k_new, v_new, k_cache, v_cache, meta, scale)) for name, b in methods.items()}
    fns["contiguous SDPA"] = lambda: sdpa().transpose(1, 2).reshape(r * new, hq, d)
    want = sdpa(q4.float(), kc.float(), vc.float()).transpose(1, 2).reshape(r * new, hq, d)
    errors, failed = {}, {}
    for name, fn in list(fns.items()):  # also the compile of each shape, untimed
        try:
            got = fn()
        except Exception as e:  # a backend that cannot run this case is reported, not fatal
            failed[name] = f"{type(e).__name__}: {e}"
            del fns[name]
            continue
        errors[name] = (got.float() - want).abs().max().item()
        assert errors[name] < (1e-3 if dtype == torch.float32 else 5e-2), f"{name} disagrees with SDPA: {errors}"
    times = _time(fns, rounds, device)
    flex = methods["flex"]
    mask_ms = None if "flex" not in fns else _time(
        {"mask": lambda: flex.paged_mask(dataclasses.replace(meta), k_cache, None)}, rounds, device)["mask"] * 1e3
    # (a fresh metadata object each call: the mask is built, not taken from the backend's cache)
    kind = "decode" if new == 1 else "prefill chunk"
    kv_bytes = 2 * r * ctx * hkv * d * k_cache.element_size()
    flops = 4 * r * hq * d * new * (cached + (new + 1) / 2)  # QK^T and PV over the visible keys
    return {"kind": kind, "requests": r, "cached": cached, "new": new, "ms": {k: t * 1e3 for k, t in times.items()},
            "gbs": {k: kv_bytes / t / 1e9 for k, t in times.items()},
            "tflops": {k: flops / t / 1e12 for k, t in times.items()}, "kv_mb": kv_bytes / 1e6,
            "flex_mask_ms": mask_ms, "max_err": errors, "failed": failed}


def _to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """The metadata with its tensors on the device (the engine uploads them with the step's inputs)."""
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})


def _time(fns: dict[str, Callable[[], object]], rounds: int, device: torch.device, inner: int = 5) -> dict[str, float]:
    """Median seconds per call; methods take turns each round, `inner` calls between synchronisations."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            times[name].append((time.perf_counter() - t) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def verdict(case: dict) -> tuple[str, str]:
    """(fastest method, why in a line): decode is bound by reading the KV once, a prefill chunk by its FLOPs."""
    ms = case["ms"]
    best = min(ms, key=ms.get)
    others = ", ".join(f"{k} {ms[k] / ms[best]:.2f}x" for k in ms if k != best)
    if case["kind"] == "decode":
        why = (f"decode reads every cached K/V byte once ({case['kv_mb']:.0f} MB), so it is memory-bound: {best} "
               f"read at {case['gbs'][best]:.0f} GB/s; the others took {others} its time")
    else:
        why = (f"a prefill chunk is compute-bound: {best} ran at {case['tflops'][best]:.1f} TFLOP/s; the others "
               f"took {others} its time")
    if best == "contiguous SDPA":
        why += " (SDPA's dense per-request KV is a copy a paged engine does not have)"
    return best, why


def _print(res: dict) -> None:
    hq, hkv, d = res["heads"]
    print(f"# attention backends on {res['name']}: {hq}/{hkv} heads, head_dim {d}, block {res['block_size']}, "
          f"{res['dtype']}; torch {torch.__version__}")
    for note in res["notes"]:
        print(f"note: {note}")
    for case in res["cases"]:
        what = (f"decode, {case['requests']} req x {case['cached'] + 1} tok" if case["kind"] == "decode" else
                f"prefill chunk, {case['requests']} req x {case['new']} new after {case['cached']} cached")
        print(f"\n| {what} | ms | GB/s of KV | TFLOP/s |\n|---|---:|---:|---:|")
        for name, err in case["failed"].items():
            print(f"| {name} | failed: {err} | | |")
        for name, ms in case["ms"].items():
            print(f"| {name} | {ms:.3f} | {case['gbs'][name]:.0f} | {case['tflops'][name]:.2f} |")
        best, why = verdict(case)
        print(f"fastest: {best}. {why}.")
        if case["flex_mask_ms"] is not None:
            print(f"flex's block mask, built once per step for all layers: {case['flex_mask_ms']:.3f} ms")
