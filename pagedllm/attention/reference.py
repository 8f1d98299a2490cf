"""Reference paged attention: pure torch, readable, the oracle every faster kernel is checked against.

KV pool per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim] in the compute
dtype, or int8 rows with their scales (kv_quant.py): the int8 mode writes quantized rows and attends over their
dequantized values, the oracle of the kernels' int8 paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.kv_quant import as_float, is_int8, quantize
from pagedllm.attention.metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter all new K/V of the batch into the pool in one indexed copy per tensor (quantized first for an int8
    pool)."""
    num_kv_heads, row = k_cache.shape[-2:]
    convert = quantize if is_int8(k_cache) else (lambda x: x.to(k_cache.dtype))
    k_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, convert(k))
    v_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, convert(v))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first: int = 0) -> torch.Tensor:
    """Tokens first..seq_len-1 of one request (first a multiple of the block size), read through its block table:
    [seq_len - first, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[first // block_size:num_blocks].long())
    return blocks.flatten(0, 1)[:seq_len - first]


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: copy block src -> dst for every pair, in every layer. One indexed copy over the whole pool
    when the caches are views of one [L, 2, N, B, H, D] tensor (allocate_kv_caches), else one per tensor."""
    if not pairs:
        return
    device = kv_caches[0][0].device
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long).to(device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long).to(device)
    pool = getattr(kv_caches, "pool", None)
    if pool is not None:
        pool.index_copy_(2, dst, pool.index_select(2, src))
        return
    for k_cache, v_cache in kv_caches:
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, Hq, N, D] over k, v [B, Hkv, L, D] (GQA), mask [.., N, L] True where a key is seen
    (None: causal, N == L). With sinks [Hq], each head's sink logit joins the softmax's denominator as a key
    whose value is zero (gpt-oss), written out in full since SDPA has no such term."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return probs @ v


class ReferenceBackend:
    """Per-request SDPA over gathered context; all single-token (decode) requests share one padded call.
    Attention math runs in float32 whatever the KV dtype (torch's bf16 SDPA on CPU is both slower and less
    accurate); the result is cast back to q's dtype."""

    name = "reference"
    cpu_kernels = True  # beside the model's C++ kernels on the CPU (the oracle of the attention alone)
    copy_blocks = staticmethod(copy_blocks)
    decode_group = 32  # decode requests attended per padded SDPA call

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """window: each query sees only the `window` most recent keys up to itself (itself included); sinks [Hq]:
        see sdpa."""
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        qf = q.float()
        qlens = meta.query_lens_list
        # single-token requests, by context length, in groups: little padding and a bounded gathered copy
        decode = sorted((r for r, n in enumerate(qlens) if n == 1), key=lambda r: meta.seq_lens_list[r])
        done: set[int] = set()
        if len(decode) > 1:
            for i in range(0, len(decode), self.decode_group):
                self._decode_batch(qf, k_cache, v_cache, meta, scale, decode[i:i + self.decode_group], out, window,
                                   sinks)
            done = set(decode)
        start = 0  # each request's first query row, from the host list (no read back from a device)
        for r, n in enumerate(qlens):
            if n and r not in done:
                out[start:start + n] = self._attend_one(qf[start:start + n], k_cache, v_cache, meta.block_tables[r],
                                                        meta.seq_lens_list[r], scale, window, sinks)
            start += n
        return out.to(q.dtype)

    @staticmethod
    def _attend_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_len: int, scale: float, window: int | None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
        n = q.shape[0]
        # keys before the first query's window are never read (their blocks may have been freed): start at the
        # block holding the first key any query sees
        first = 0 if window is None else max(0, seq_len - n - window + 1) // k_cache.shape[1] * k_cache.shape[1]
        k = as_float(gather_context(k_cache, block_table, seq_len, first), q.dtype)
        v = as_float(gather_context(v_cache, block_table, seq_len, first), q.dtype)
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        mask = None  # nothing cached: plain causal
        if n != seq_len or window is not None:  # query i sits at position seq_len - n + i and sees the keys up to it
            qpos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]  # (within its window)
            kpos = torch.arange(first, seq_len, device=q.device)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
        return sdpa(qh, kh, vh, mask, scale, sinks)[0].transpose(0, 1)

    @staticmethod
    def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, reqs: list[int], out: torch.Tensor, window: int | None,
                      sinks: torch.Tensor | None) -> None:
        idx = torch.tensor(reqs, dtype=torch.long).to(q.device)
        rows = meta.query_start_loc[idx].long()
        seq_lens = meta.seq_lens[idx].long()
        block_size = k_cache.shape[1]
        max_len = max(meta.seq_lens_list[r] for r in reqs)
        nb = -(-max_len // block_size)
        tables = meta.block_tables[idx, :nb].long()  # padded entries point at block 0, masked below
        k = as_float(k_cache[tables].flatten(1, 2)[:, :max_len], q.dtype)  # [R, L, Hkv, D]
        v = as_float(v_cache[tables].flatten(1, 2)[:, :max_len], q.dtype)
        kpos = torch.arange(max_len, device=q.device)[None, :]
        mask = kpos < seq_lens[:, None]
        if window is not None:  # keys outside the window are masked; their (maybe freed) blocks read as padding
            mask &= kpos >= seq_lens[:, None] - window
        # a masked key's weight is 0, but 0 x NaN is NaN: the padding (another request's freed block, maybe
        # poisoned) is zeroed so that it cannot reach this request's output
        valid = mask[:, :, None, None]
        k, v = k.where(valid, 0.0), v.where(valid, 0.0)
        mask = mask[:, None, None, :]
        qh = q[rows][:, :, None, :]  # [R, Hq, 1, D]
        out[rows] = sdpa(qh, k.transpose(1, 2), v.transpose(1, 2), mask, scale, sinks)[:, :, 0, :]
