"""The "flex" attention backend: PyTorch FlexAttention over the paged KV pool, with a block mask built from the
block tables (PagedAttention on FlexAttention, as in IBM's Foundation Model Stack paper).

Layout. The pool [num_blocks, block_size, Hkv, D] is viewed, without a copy, as one KV sequence
[1, Hkv, num_blocks * block_size, D] that every request shares (flex broadcasts a KV batch of 1). The flat batch's
queries are laid out per request, [R, Hq, Qmax, D] (batch = request, each request's queries from row 0, the rest
padding), so one flex call covers decode, prefill, chunks against cached blocks and mixed batches. GQA through
enable_gqa.

Block mask. Its KV block is the pool's block, its query tile Q_TILE rows of a request. For each (request, tile)
the block mask lists the physical blocks that hold a key any of the tile's queries may see (the block table read
from the block of the first query's window start to the block of the last query), so flex reads those blocks in
place and nothing else: blocks wholly outside a window (maybe freed and reused) and other requests' blocks are
never read. Blocks whose every (query, key) pair is visible go in the full-block lists (no mask_mod: every block
before the last one in a decode step; on cuda a decode step lists none, see FlexAttentionBackend); the others (the causal diagonal, window edges, the partial last block, a
tile with padding rows) go through mask_mod, which maps a physical slot to the request's logical position through
a physical->logical table per request ([R, num_blocks], as attention-gym's PagedAttention) and applies
causality (query i of request r sits at position seq_len - n + i), the window (keys after qpos - window) and the
request's own blocks. mask_mod is exact on its own (eager flex evaluates it for every slot of the pool); the block
lists are what the compiled kernel visits. All of it is built with torch ops on the pool's device from the
metadata's tensors; shapes come from its host lists, never from reading a device tensor back. The mask is built
once per step and reused by every layer (the backend keeps the last few, keyed by the metadata object).

Compile. Eager flex materialises the scores over the whole pool (tests, small pools); torch.compile(flex_attention)
generates a fused kernel that visits only the listed blocks (on cuda a must). Compiled graphs are static, so the
shapes are bucketed to repeat: requests padded to the next power of two, Qmax to 1 (decode) or the next power of
two >= 16, and on cuda the block lists' width to the next power of four >= 16 of the most blocks a tile can list
(unused entries cost only index memory; on the CPU the width is the pool's block count, which inductor's CPU
template requires). A serving run thus compiles a graph per (requests, Qmax, width) bucket it meets, and per
window size and scale: a few tens. Dynamo's recompile limit (8) is raised to RECOMPILE_LIMIT for these calls
only, and reaching it raises rather than falling back to eager flex (scores over the whole pool).

Precision. q is cast to the pool's dtype (flex wants one dtype; casting the pool would copy it). The kernel
accumulates in float32; with a bf16 pool, q.k^T has bf16 inputs and the probabilities are rounded to bf16 before
P.V (flash-attention's precision); with a float32 pool on cuda its dots follow torch's float32 matmul precision
(IEEE unless TF32 is allowed); the eager path computes the scores in float32 and P.V in the pool's dtype. The
output is cast back to q's dtype. Sinks: flex returns the natural-log logsumexp of each row's scaled scores, and a
sink logit s in the denominator scales the output by e^lse / (e^lse + e^s) = sigmoid(lse - s).

Limits. int8 KV pools are refused (the "triton" backend reads them). A block the mask lists is read whole: masked
slots weigh 0, but 0 x NaN is NaN, so each step clears the slots past a request's length in its last block
(clear_tails: a reused block may hold a failed request's non-finite K/V). Eager flex reads every value of the pool:
one NaN value anywhere reaches every output; it is for tests.
On cuda the block size must be a power of two >= 16 (it is flex's KV tile). Inductor's CPU template cannot
return the logsumexp, so with sinks a compiled CPU call runs eager flex.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from pagedllm.attention import register_backend
from pagedllm.attention.kv_quant import is_int8
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import copy_blocks, write_kv

Q_TILE = 128  # query rows per block-mask tile: a multiple of the kernels' BLOCK_M on cuda
MIN_PREFILL_Q = 16  # Qmax bucket floor when any request has more than one query
CACHED_MASKS = 4  # block masks kept per backend (a step's layers reuse them)
RECOMPILE_LIMIT = 256  # graphs per process for the compiled flex call (dynamo's default is 8)

_compiled = None


def _compiled_flex():
    global _compiled
    if _compiled is None:  # fullgraph: a graph break would fall back to eager flex, scores over the whole pool
        _compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _compiled


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def bucket_shape(num_requests: int, max_query_len: int) -> tuple[int, int]:
    """(padded requests, padded Qmax) of the compiled path: powers of two, Qmax 1 or >= MIN_PREFILL_Q."""
    q = 1 if max_query_len <= 1 else max(MIN_PREFILL_Q, _pow2(max_query_len))
    return _pow2(max(num_requests, 1)), q


@dataclass
class PagedMask:
    """A step's block mask and what forward needs besides: where each token's row sits in the padded layout."""
    block_mask: BlockMask
    rows: int  # padded requests
    qmax: int  # padded queries per request
    dest: torch.Tensor  # [T] token -> row * qmax + query index (its place in [rows * qmax])


def build_paged_mask(meta: AttentionMetadata, num_blocks: int, block_size: int, device: torch.device,
                     window: int | None = None, rows: int | None = None, qmax: int | None = None,
                     full_blocks: bool = True, width: int | None = None) -> PagedMask:
    """The block mask of one step over a pool of num_blocks blocks (see the module docstring). rows, qmax: the
    padded layout (default: exact); width: entries per block list (default: what the device needs)."""
    r, t = meta.num_requests, meta.num_tokens
    rows = r if rows is None else rows
    qmax = max(meta.max_query_len, 1) if qmax is None else qmax
    bs = block_size
    qsl = meta.query_start_loc.to(device).long()
    qlen = torch.zeros(rows, dtype=torch.long, device=device)
    qlen[:r] = qsl[1:] - qsl[:-1]
    seq = torch.zeros(rows, dtype=torch.long, device=device)
    seq[:r] = meta.seq_lens.to(device).long()
    ctx = seq - qlen  # position of each request's first query
    tables = meta.block_tables.to(device).long()
    if rows > r:
        tables = torch.cat([tables, tables.new_zeros(rows - r, tables.shape[1])])
    max_logical = tables.shape[1]

    # physical -> logical block of each request, -1 where not its live block; column num_blocks takes the rest
    j = torch.arange(max_logical, device=device)
    live = j[None, :] < (seq[:, None] + bs - 1) // bs
    if window is not None:  # blocks before the first query's window may have been freed (NULL_BLOCK entries)
        live &= j[None, :] >= (ctx[:, None] - window + 1).clamp(min=0) // bs
    p2l = torch.full((rows, num_blocks + 1), -1, dtype=torch.int32, device=device)
    p2l.scatter_(1, torch.where(live, tables, num_blocks), j.to(torch.int32).expand(rows, -1).contiguous())

    # per (request, tile): the logical blocks its real queries see, and the ones every query sees in full
    tiles = -(-qmax // Q_TILE)
    lo_row = torch.arange(tiles, device=device) * Q_TILE
    end_row = (lo_row + Q_TILE).clamp(max=qmax)
    real_end = torch.minimum(end_row[None, :], qlen[:, None])
    has = real_end > lo_row[None, :]
    qlo = ctx[:, None] + lo_row[None, :]  # first and last real query positions of the tile
    qhi = ctx[:, None] + real_end - 1
    first = torch.zeros_like(qlo) if window is None else (qlo - window + 1).clamp(min=0) // bs
    last = qhi.div(bs, rounding_mode="floor")
    count = torch.where(has, last - first + 1, 0)
    if full_blocks:
        f_first = (torch.zeros_like(qhi) if window is None
                   else ((qhi - window + 1).clamp(min=0) + bs - 1) // bs)
        f_last = (qlo + 1).div(bs, rounding_mode="floor") - 1  # last block wholly at or before the first query
        all_real = has & (end_row[None, :] <= qlen[:, None])  # padding rows see nothing: not full
        nfull = torch.where(all_real, (f_last - f_first + 1).clamp(min=0), 0)
    else:
        f_first, nfull = first, torch.zeros_like(count)
    lead = torch.where(nfull > 0, f_first - first, count)  # partial blocks before the full run, then after it
    npart = count - nfull

    if width is None:
        width = _list_width(meta, num_blocks, bs, device, window, qmax)
    c = torch.arange(width, device=device)[None, None, :]
    part_j = torch.where(c < lead[..., None], first[..., None] + c, f_first[..., None] + nfull[..., None] + c
                         - lead[..., None])
    part = _physical(tables, part_j, c < npart[..., None])
    kv_num, kv_idx = npart.to(torch.int32)[:, None], part[:, None]
    full_num = full_idx = None
    if full_blocks:
        full = _physical(tables, f_first[..., None] + c, c < nfull[..., None])
        full_num, full_idx = nfull.to(torch.int32)[:, None], full[:, None]

    ctx32, qlen32 = ctx.to(torch.int32), qlen.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        logical = p2l[b, kv_idx // bs]
        k = logical * bs + kv_idx % bs
        qpos = ctx32[b] + q_idx
        seen = (logical >= 0) & (q_idx < qlen32[b]) & (k <= qpos)
        if window is not None:
            seen = seen & (k > qpos - window)
        return seen

    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(Q_TILE, bs), mask_mod=mask_mod,
                                    seq_lengths=(qmax, num_blocks * bs), compute_q_blocks=False)
    req = torch.repeat_interleave(torch.arange(r, device=device), qlen[:r], output_size=t)
    dest = req * qmax + torch.arange(t, device=device) - qsl[req]
    return PagedMask(mask, rows, qmax, dest)


def _physical(tables: torch.Tensor, logical: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Block-table entries at logical [rows, tiles, width] where valid, else block 0 (never visited) -> int32."""
    rows, tiles, width = logical.shape
    idx = logical.clamp(0, tables.shape[1] - 1).reshape(rows, -1)
    phys = torch.gather(tables, 1, idx).view(rows, tiles, width)
    return torch.where(valid, phys, 0).to(torch.int32)


def _list_width(meta: AttentionMetadata, num_blocks: int, bs: int, device: torch.device, window: int | None,
                qmax: int) -> int:
    """Entries per block list. Inductor's CPU template wants the whole pool; on cuda the most blocks a tile can
    list, to the next power of four (a coarse bucket: the width is part of the compiled graph's shape)."""
    most = -(-meta.max_seq_len // bs)
    if window is not None:  # the queries of one tile and the window before the first
        most = min(most, -(-(min(qmax, Q_TILE) + window - 1) // bs) + 1)
    if device.type == "cpu":
        return max(num_blocks, most, 1)
    width = 16
    while width < most:
        width *= 4
    return width


class FlexAttentionBackend:
    """FlexAttention over the paged pool (see the module docstring).

    compile: torch.compile the flex call (None: on cuda yes, on the CPU no). bucket: pad requests and Qmax to the
    buckets of bucket_shape (None: when compiled). full_blocks: list the blocks that need no mask_mod apart
    (None: yes, except on cuda in a decode step, where flex's split-KV decode kernel sizes its splits by the whole
    KV length when full blocks are given, i.e. the pool's, and one split would do all of a request's work).
    """

    name = "flex"
    copy_blocks = staticmethod(copy_blocks)

    def __init__(self, compile: bool | None = None, bucket: bool | None = None,
                 full_blocks: bool | None = None) -> None:
        self.compile = compile
        self.bucket = bucket
        self.full_blocks = full_blocks
        self._cache: list[tuple[weakref.ref, tuple, PagedMask]] = []  # the last few (metadata, key) masks

    def paged_mask(self, meta: AttentionMetadata, k_cache: torch.Tensor, window: int | None) -> PagedMask:
        """The step's mask, built on the first layer's call and reused by the others (same metadata object)."""
        compiled = self._compiled(k_cache.device)
        bucket = compiled if self.bucket is None else self.bucket
        rows, qmax = (bucket_shape(meta.num_requests, meta.max_query_len) if bucket
                      else (meta.num_requests, max(meta.max_query_len, 1)))
        full = self.full_blocks
        if full is None:
            full = not (k_cache.device.type == "cuda" and qmax == 1)
        key = (tuple(k_cache.shape[:2]), k_cache.device, window, rows, qmax, full)
        for ref, cached_key, pm in self._cache:
            if ref() is meta and cached_key == key:
                return pm
        pm = build_paged_mask(meta, k_cache.shape[0], k_cache.shape[1], k_cache.device, window, rows, qmax, full)
        # a few entries: layers may alternate windows (sliding / global) or metadata (one per KV group)
        self._cache = [(weakref.ref(meta), key, pm), *self._cache[:CACHED_MASKS - 1]]
        return pm

    def _compiled(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.compile is None else self.compile

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if is_int8(k_cache):
            raise ValueError("the flex attention backend does not read int8 KV pools; use the 'triton' backend "
                             "(or 'cpu') for int8 KV")
        device = k_cache.device
        nb, bs, hkv, d = k_cache.shape
        if device.type == "cuda" and (bs < 16 or bs & (bs - 1)):
            raise ValueError(f"flex attention on cuda needs a block size that is a power of two >= 16, got {bs}")
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping.to(device))
        clear_tails(k_cache, v_cache, meta)
        t, hq, _ = q.shape
        if t == 0:
            return q.new_empty(q.shape)
        pm = self.paged_mask(meta, k_cache, window)
        # the queries in the padded layout [rows, qmax, Hq, D] (a view when there is no padding: decode)
        qd = q.to(k_cache.dtype)
        if t == pm.rows * pm.qmax:
            qp = qd.view(pm.rows, pm.qmax, hq, d)
        else:
            qp = qd.new_zeros(pm.rows * pm.qmax, hq, d).index_copy_(0, pm.dest, qd).view(pm.rows, pm.qmax, hq, d)
        kf = k_cache.view(1, nb * bs, hkv, d).transpose(1, 2)  # the pool as one sequence, no copy
        vf = v_cache.view(1, nb * bs, hkv, d).transpose(1, 2)
        compiled = self._compiled(device)
        want_lse = sinks is not None
        if compiled and want_lse and device.type == "cpu":
            compiled = False  # inductor's CPU flex cannot return the logsumexp
        out, lse = _run_flex(qp.transpose(1, 2), kf, vf, pm.block_mask, scale, hq != hkv, want_lse, compiled,
                             bs, pm.qmax, device)
        rows_out = out.transpose(1, 2).reshape(-1, hq, d)
        res = rows_out if t == pm.rows * pm.qmax else rows_out.index_select(0, pm.dest)
        if sinks is not None:
            lse_rows = lse.transpose(1, 2).reshape(-1, hq)
            lse_rows = lse_rows if t == pm.rows * pm.qmax else lse_rows.index_select(0, pm.dest)
            res = res.float() * torch.sigmoid(lse_rows - sinks.to(device, torch.float32))[..., None]
        return res.to(q.dtype)


def clear_tails(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Zero the slots past each request's length in its last block. Flex reads a listed block whole, and a masked
    slot weighs 0, but 0 x NaN is NaN: a reused block may hold what a failed request left (non-finite K/V). Those
    slots are the request's own future ones (a partly filled block is shared only by forks of one prefix, whose
    tails are alike unwritten), so clearing them changes no result. Without reading a device value back: every
    slot of each last block is read, the tail zeroed, and written back."""
    nb, bs = k_cache.shape[:2]
    seq = meta.seq_lens.to(k_cache.device, torch.int64)
    if seq.numel() == 0:
        return
    last = meta.block_tables.to(k_cache.device, torch.int64).gather(1, ((seq - 1).clamp(min=0) // bs)[:, None])
    offsets = torch.arange(bs, device=k_cache.device)
    slots = (last * bs + offsets).reshape(-1)
    filled = seq % bs
    tail = ((offsets[None, :] >= filled[:, None]) & (filled[:, None] > 0)).reshape(-1, 1, 1)
    for cache in (k_cache, v_cache):
        flat = cache.view(nb * bs, *cache.shape[2:])
        flat.index_copy_(0, slots, flat.index_select(0, slots).masked_fill(tail, 0))


def _run_flex(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, block_mask: BlockMask, scale: float, gqa: bool,
              want_lse: bool, compiled: bool, block_size: int, qmax: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    aux = AuxRequest(lse=True) if want_lse else None
    if not compiled:
        res = flex_attention(q4, k4, v4, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=aux)
    else:
        opts: dict[str, int | str] | None = None
        if device.type == "cuda":
            opts = {}
            if block_size < 128:  # flex's KV tile must divide the mask's KV block (the pool's block)
                opts["BLOCK_N"] = block_size
            if qmax > 1:  # prefill tiles: the main kernel (flex's decode kernel is for a handful of query rows)
                opts["BACKEND"] = "TRITON"
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            res = _compiled_flex()(q4, k4, v4, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                                   kernel_options=opts, return_aux=aux)
    if aux is None:
        return res, None
    out, extra = res
    return out, extra.lse


register_backend("flex", FlexAttentionBackend, priority={"cuda": 25, "cpu": -1})
