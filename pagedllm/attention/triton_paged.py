"""The "triton" attention backend: paged attention in Triton, reading K/V in place through the block tables.

forward writes the new K/V into the pool (reference.write_kv, also for int8 pools), then attends with two kernels,
each request going to one of them by its query count:

- decode (requests of one query): grid (request, KV head, split). All query heads of the KV head are the rows of
  one tile (padded to 16 rows for tl.dot), so one pass over a KV tile serves the whole GQA group. Long contexts
  are split flash-decoding style: split s covers keys [k0 + s * L, k0 + (s + 1) * L) where k0 is the request's
  first visible key (0, or its window's start) and L a whole number of blocks; each split writes its partial
  (max, sum, acc) and a small kernel merges them in split order. The grid depends on shapes only (number of
  requests, block_tables.shape[1], heads, window): seq_lens are read inside the kernels, and splits past a
  request's length write a neutral partial (the merge reads only the live ones), so the launch can be captured in
  a CUDA graph. Split rule: L = max(split_tokens, the table's keys / max_splits), rounded up to whole blocks, and
  as many splits as the widest request could need (block_tables.shape[1] blocks, or the window). Below
  max_splits * split_tokens keys, L is fixed, so a request's splits do not depend on the other requests: its
  output is bitwise the same alone or in any batch (one live split merges exactly to the unsplit result).
- prefill / chunk (requests of two or more queries, against cached blocks or not): grid (query tile, KV head), a
  tile being BLOCK_M consecutive queries of one request times the GQA group (a host-built tile -> (request, first
  query) table: varlen requests in one launch); it loops over the keys its queries can see (causal, window). A
  tile depends on its own request only: batch invariant too.

In a mixed batch both kernels run (decodes through the decode kernel, whatever else the batch holds), so a
request's output never depends on the batch. Key tiles are gathered token by token through the block table (any
block size, no gathered copy); a query's keys start at the first one it can see, so blocks before a window are
never read (a freed block's table entry may be anything). Math in fp32 with an online softmax in base 2; the
query-key dot runs on the 16-bit values when q and the cache share a 16-bit dtype (exact products, fp32 sums),
else on fp32 values (int8 rows dequantized as value * f16 scale, exact in fp32), with input_precision="ieee"
(no TF32). gpt-oss's sinks join the denominator at the end: sum + exp(sink - max). Head dims: any, through a
power-of-two range masked to the head dim (64, 128, 256 exact; e.g. 80 pads to 128).

Without CUDA the kernels run in Triton's interpreter on CPU tensors, for the tests; "auto" never picks them there
(a negative cpu priority).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

# Triton decides at each @triton.jit decoration whether the function is compiled or interpreted
# (knobs.runtime.interpret, read from TRITON_INTERPRET then): without CUDA this module's kernels must run
# interpreted on CPU tensors (the tests). triton.language's own jit functions (tl.zeros, tl.sum, tl.max, ...) are
# decorated when triton.language is first imported, and an interpreted kernel cannot call compiled ones: the
# variable must be set before anyone imports triton. This module sets it where it is the first; the tests' conftest
# sets it before any test module is imported; elsewhere the backend refuses to build (INTERPRETED below).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pagedllm.attention import register_backend  # noqa: E402
from pagedllm.attention.kv_quant import cache_head_dim, is_int8  # noqa: E402
from pagedllm.attention.metadata import AttentionMetadata  # noqa: E402
from pagedllm.attention.reference import copy_blocks, write_kv  # noqa: E402

LOG2E = math.log2(math.e)


@triton.jit
def _attend(q, qpos, m, den, acc, k_ptr, v_ptr, bt_row, lo, hi, head_off, s_blk, s_tok, qk_scale, window,
            HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            KV_INT8: tl.constexpr, QK_NATIVE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Online softmax of the rows q [ROWS, HEAD_P] (at positions qpos) over keys lo..hi-1, in tiles of BLOCK_N keys
    gathered through the block table row bt_row; m, den (base-2 max and sum) and acc carried in and out."""
    d = tl.arange(0, HEAD_P)
    d_ok = d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi
        blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        row = blk * s_blk + (kpos % BLOCK_SIZE) * s_tok + head_off
        mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=mask, other=0)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=mask, other=0)
        if KV_INT8:  # each row's f16 scale sits in its two bytes after the values (rows are 2-byte aligned)
            k_scale = tl.load((k_ptr + row + HEAD_DIM).to(tl.pointer_type(tl.float16)), mask=k_ok, other=0)
            v_scale = tl.load((v_ptr + row + HEAD_DIM).to(tl.pointer_type(tl.float16)), mask=k_ok, other=0)
            k = k.to(tl.float32) * k_scale.to(tl.float32)[:, None]
            v = v.to(tl.float32) * v_scale.to(tl.float32)[:, None]
        if QK_NATIVE:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = s * qk_scale
        seen = k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            seen = seen & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet: no NaN
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        den = den * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        m = m_new
    return m, den, acc


@triton.jit
def _finish(m, den, acc, sinks_ptr, head, row_ok, HAS_SINKS: tl.constexpr):
    """acc / den, with each head's sink logit (natural units) in the denominator."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0).to(tl.float32) * 1.4426950408889634
        den = den + tl.exp2(sink - m)
    den = tl.where(den > 0, den, 1.0)  # padding rows
    return acc / den[:, None]


@triton.jit
def _decode_request(i, req_idx_ptr, seq_lens_ptr, qsl_ptr, window, HAS_WINDOW: tl.constexpr,
                    USE_REQ_IDX: tl.constexpr):
    """Decode program i's request, its length, its query's row and the first key its window sees."""
    req = i
    if USE_REQ_IDX:  # a mixed batch: the decode requests among the others
        req = tl.load(req_idx_ptr + i)
    seq_len = tl.load(seq_lens_ptr + req)
    tok = tl.load(qsl_ptr + req).to(tl.int64)
    k0 = seq_len * 0
    if HAS_WINDOW:
        k0 = tl.maximum(seq_len - window, 0)
    return req, seq_len, tok, k0


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_ml_ptr, part_acc_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
                   req_idx_ptr, sinks_ptr, s_qt, s_qh, s_ot, s_oh, s_blk, s_tok, s_head, s_bt, qk_scale, window,
                   split_len, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   KV_INT8: tl.constexpr, QK_NATIVE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_SINKS: tl.constexpr, USE_REQ_IDX: tl.constexpr, SPLIT: tl.constexpr):
    """One split of one decode request's keys, all query heads of one KV head; SPLIT: write the partial (max,
    sum, acc) for _merge_kernel, else (a single split) the output."""
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req, seq_len, tok, k0 = _decode_request(i, req_idx_ptr, seq_lens_ptr, qsl_ptr, window, HAS_WINDOW, USE_REQ_IDX)
    lo = k0 + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)  # lo >= hi: a split past the context, neutral partial

    rows = tl.arange(0, ROWS)
    d = tl.arange(0, HEAD_P)
    row_ok = rows < GROUP
    head = kvh * GROUP + rows
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + tok * s_qt + head[:, None] * s_qh + d[None, :], mask=mask, other=0)
    if not QK_NATIVE:
        q = q.to(tl.float32)
    qpos = tl.zeros([ROWS], tl.int32) + seq_len - 1
    m = tl.full([ROWS], float("-inf"), tl.float32)
    den = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_P], tl.float32)
    m, den, acc = _attend(q, qpos, m, den, acc, k_ptr, v_ptr, bt_ptr + req.to(tl.int64) * s_bt, lo, hi,
                        kvh * s_head, s_blk, s_tok, qk_scale, window, HEAD_DIM, HEAD_P, BLOCK_SIZE, BLOCK_N,
                        KV_INT8, QK_NATIVE, HAS_WINDOW)
    if SPLIT:
        part = (i * NUM_HEADS + head).to(tl.int64) * tl.num_programs(2) + split
        tl.store(part_ml_ptr + 2 * part, m, mask=row_ok)
        tl.store(part_ml_ptr + 2 * part + 1, den, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=mask)
    else:
        out = _finish(m, den, acc, sinks_ptr, head, row_ok, HAS_SINKS)
        tl.store(out_ptr + tok * s_ot + head[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _merge_kernel(out_ptr, part_ml_ptr, part_acc_ptr, seq_lens_ptr, qsl_ptr, req_idx_ptr, sinks_ptr, s_ot, s_oh,
                  window, split_len, num_splits, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
                  GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_SINKS: tl.constexpr, USE_REQ_IDX: tl.constexpr):
    """Merges one decode request's live splits (those holding keys), in split order, for one KV head's group."""
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    _, seq_len, tok, k0 = _decode_request(i, req_idx_ptr, seq_lens_ptr, qsl_ptr, window, HAS_WINDOW, USE_REQ_IDX)
    live = tl.cdiv(seq_len - k0, split_len)

    rows = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_P)
    row_ok = rows < GROUP
    head = kvh * GROUP + rows
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    base = (i * NUM_HEADS + head).to(tl.int64) * num_splits
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    den = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_P], tl.float32)
    for s in range(0, live):
        m_s = tl.load(part_ml_ptr + 2 * (base + s), mask=row_ok, other=0.0)
        den_s = tl.load(part_ml_ptr + 2 * (base + s) + 1, mask=row_ok, other=0.0)
        acc_s = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, m_s)  # a live split has seen a key: m_s, hence m_new, is finite
        a = tl.exp2(m - m_new)
        b = tl.exp2(m_s - m_new)
        den = den * a + den_s * b
        acc = acc * a[:, None] + acc_s * b[:, None]
        m = m_new
    out = _finish(m, den, acc, sinks_ptr, head, row_ok, HAS_SINKS)
    tl.store(out_ptr + tok * s_ot + head[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tiles_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, sinks_ptr, s_qt, s_qh,
                    s_ot, s_oh, s_blk, s_tok, s_head, s_bt, qk_scale, window, GROUP: tl.constexpr,
                    GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KV_INT8: tl.constexpr,
                    QK_NATIVE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr):
    """BLOCK_M consecutive queries of one request (tiles_ptr: its index and first query) x the query heads of one
    KV head, against every key they can see."""
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(tiles_ptr + 2 * t)
    m0 = tl.load(tiles_ptr + 2 * t + 1)
    q_start = tl.load(qsl_ptr + req)
    n = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    first = seq_len - n + m0  # the tile's first query's position
    lo = first * 0
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    hi = tl.minimum(first + BLOCK_M, seq_len)

    rows = tl.arange(0, BLOCK_M * GROUP_P)
    d = tl.arange(0, HEAD_P)
    qi = m0 + rows // GROUP_P
    g = rows % GROUP_P
    row_ok = (qi < n) & (g < GROUP)
    head = kvh * GROUP + g
    tok = (q_start + qi).to(tl.int64)
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + d[None, :], mask=mask, other=0)
    if not QK_NATIVE:
        q = q.to(tl.float32)
    qpos = seq_len - n + qi
    m = tl.full([BLOCK_M * GROUP_P], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P, HEAD_P], tl.float32)
    m, den, acc = _attend(q, qpos, m, den, acc, k_ptr, v_ptr, bt_ptr + req.to(tl.int64) * s_bt, lo, hi,
                        kvh * s_head, s_blk, s_tok, qk_scale, window, HEAD_DIM, HEAD_P, BLOCK_SIZE, BLOCK_N,
                        KV_INT8, QK_NATIVE, HAS_WINDOW)
    out = _finish(m, den, acc, sinks_ptr, head, row_ok, HAS_SINKS)
    tl.store(out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


# True where the kernels run in Triton's interpreter (no CUDA here): on CPU tensors, for the tests. They can run
# only if triton.language's jit functions are interpreted too (triton imported after TRITON_INTERPRET was set).
INTERPRETED = not isinstance(_prefill_kernel, triton.JITFunction)
_LANGUAGE_INTERPRETED = not isinstance(tl.zeros, triton.JITFunction)


@dataclass
class _Launch:
    """What both kernels of one forward share."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out: torch.Tensor
    meta: AttentionMetadata
    sinks: torch.Tensor  # q where there are none (never read then)
    qk_scale: float  # scale * log2(e): the kernels' softmax is in base 2
    window: int | None
    group: int
    consts: dict  # the constexprs both kernels take

    def strides(self) -> tuple[int, ...]:
        q, out, kc = self.q, self.out, self.k_cache
        return (q.stride(0), q.stride(1), out.stride(0), out.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
                self.meta.block_tables.stride(0))


class TritonAttentionBackend:
    """The Triton kernels behind the backend interface. split_tokens / max_splits: the decode split rule (module
    docstring); tests lower split_tokens to split short contexts."""

    name = "triton"
    copy_blocks = staticmethod(copy_blocks)
    # a decode step can be captured in a CUDA graph (worker/decode_graphs.py): its launch depends only on shapes
    cuda_graphs = True
    split_tokens = 256  # a decode split's fewest keys: below it the merge costs more than the parallelism gains
    max_splits = 64  # bounds the partials' memory and the merge's length on very wide block tables

    def __init__(self) -> None:
        if not INTERPRETED and not torch.cuda.is_available():
            raise RuntimeError("the triton attention kernels need CUDA, or TRITON_INTERPRET=1 set before triton is "
                               "imported (to run them interpreted on the CPU)")
        if INTERPRETED != _LANGUAGE_INTERPRETED:
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so triton.language's jit "
                               "functions are compiled and the interpreted kernels cannot call them: set "
                               "TRITON_INTERPRET=1 in the environment, or import pagedllm.attention.triton_paged "
                               "before triton")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0:
            return out
        num_kv_heads, head_dim = k_cache.shape[2], cache_head_dim(k_cache)
        if q.shape[-1] != head_dim or q.shape[1] % num_kv_heads:
            raise ValueError(f"q {tuple(q.shape)} does not fit the pool {tuple(k_cache.shape)} (head dim {head_dim}, "
                             f"{num_kv_heads} KV heads)")
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError("the K and V pools must share one layout, rows contiguous")
        if q.stride(-1) != 1:
            q = q.contiguous()
        # q . k on 16-bit values where q and the cache share a 16-bit dtype; the interpreter multiplies bf16's bit
        # patterns in tl.dot (triton-lang/triton#11584), so bf16 takes the fp32 dot there (fp16 tests the 16-bit path)
        native = q.dtype == k_cache.dtype and (q.dtype == torch.float16 or (q.dtype == torch.bfloat16
                                                                            and not INTERPRETED))
        head_p = max(16, triton.next_power_of_2(head_dim))  # tl.dot wants 16 at least
        consts = dict(HEAD_DIM=head_dim, HEAD_P=head_p, BLOCK_SIZE=k_cache.shape[1],
                      BLOCK_N=32 if head_p <= 128 else 16,  # keys per tile (fewer at 256: registers)
                      KV_INT8=is_int8(k_cache), QK_NATIVE=native, HAS_WINDOW=window is not None,
                      HAS_SINKS=sinks is not None)
        run = _Launch(q, k_cache, v_cache, out, meta, q if sinks is None else sinks.contiguous(), scale * LOG2E,
                      window, q.shape[1] // num_kv_heads, consts)
        decodes = [r for r, n in enumerate(meta.query_lens_list) if n == 1]
        if decodes:
            self._decode(run, None if len(decodes) == meta.num_requests else decodes)
        longer = [r for r, n in enumerate(meta.query_lens_list) if n > 1]
        if longer:
            self._prefill(run, longer)
        return out

    def split_rule(self, table_width: int, block_size: int, window: int | None) -> tuple[int, int]:
        """(keys per split, number of splits) of a decode launch, from shapes only (and the layer's window): the
        splits cover the most keys a request of this table width can see."""
        keys = table_width * block_size if window is None else min(table_width * block_size, window)
        per = max(self.split_tokens, -(-keys // self.max_splits))
        per = -(-per // block_size) * block_size  # whole blocks
        return per, -(-keys // per)

    def _decode(self, run: _Launch, reqs: list[int] | None) -> None:
        """reqs: the decode requests of a mixed batch (None: all of them)."""
        q, meta = run.q, run.meta
        num_reqs = meta.num_requests if reqs is None else len(reqs)
        num_heads, num_kv_heads = q.shape[1], run.k_cache.shape[2]
        req_idx = meta.seq_lens if reqs is None else torch.tensor(reqs, dtype=torch.int32).to(q.device)
        split_len, num_splits = self.split_rule(meta.block_tables.shape[1], run.k_cache.shape[1], run.window)
        split = num_splits > 1
        part_ml = part_acc = run.out  # unused without a split
        if split:
            part_ml = torch.empty(num_reqs, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
            part_acc = torch.empty(num_reqs, num_heads, num_splits, q.shape[-1], dtype=torch.float32,
                                   device=q.device)
        window = run.window or 0
        _decode_kernel[(num_reqs, num_kv_heads, num_splits)](
            q, run.k_cache, run.v_cache, run.out, part_ml, part_acc, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, req_idx, run.sinks, *run.strides(), run.qk_scale, window, split_len,
            NUM_HEADS=num_heads, GROUP=run.group, ROWS=max(16, triton.next_power_of_2(run.group)),
            USE_REQ_IDX=reqs is not None, SPLIT=split, **run.consts)
        if split:
            consts = {k: run.consts[k] for k in ("HEAD_DIM", "HEAD_P", "HAS_WINDOW", "HAS_SINKS")}
            _merge_kernel[(num_reqs, num_kv_heads)](
                run.out, part_ml, part_acc, meta.seq_lens, meta.query_start_loc, req_idx, run.sinks,
                run.out.stride(0), run.out.stride(1), window, split_len, num_splits, NUM_HEADS=num_heads,
                GROUP=run.group, GROUP_P=triton.next_power_of_2(run.group), USE_REQ_IDX=reqs is not None, **consts)

    def _prefill(self, run: _Launch, reqs: list[int]) -> None:
        """reqs: the requests of two or more queries."""
        group_p = triton.next_power_of_2(run.group)
        # tiles of 64 rows (32 at head dim 256: the accumulator's registers), at least the whole group; fixed per
        # shape, never from the batch, so a request's tiles are the same in any batch
        block_m = max(1, (64 if run.consts["HEAD_P"] <= 128 else 32) // group_p)
        lens = np.asarray(run.meta.query_lens_list, dtype=np.int64)[reqs]
        per = -(-lens // block_m)
        req = np.repeat(np.asarray(reqs, dtype=np.int64), per)
        first = (np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)) * block_m
        tiles = torch.from_numpy(np.stack([req, first], 1).astype(np.int32)).to(run.q.device)
        meta = run.meta
        _prefill_kernel[(tiles.shape[0], run.k_cache.shape[2])](
            run.q, run.k_cache, run.v_cache, run.out, tiles, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            run.sinks, *run.strides(), run.qk_scale, run.window or 0, GROUP=run.group, GROUP_P=group_p,
            BLOCK_M=block_m, **run.consts)


register_backend("triton", TritonAttentionBackend, priority={"cuda": 30, "cpu": -1})
