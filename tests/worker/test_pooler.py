"""The Pooler across chunks, and across a preemption whose request comes back at a block boundary (its own cached
blocks) and recomputes from there: every row counts once."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.request import Request
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.model.pooling_config import PoolingConfig
from pagedllm.pooling_params import PoolingParams
from pagedllm.worker.pooler import Pooler, finish_embedding

BLOCK = 16


def _chunk(pooler: Pooler, prompt: list[int], rows: torch.Tensor, start: int, end: int):
    """Run rows[start:end] of the prompt through the pooler as one scheduled entry (after another request's rows,
    so that the entry's offset in the batch is not 0)."""
    req = Request("r#0", prompt, num_computed_tokens=start, prefill_only=True, sampling_params=PoolingParams())
    other = Request("g#0", [1, 2, 3])
    batch = [ScheduledRequest(other, 3, [], True), ScheduledRequest(req, end - start, [], end == len(prompt))]
    hidden = torch.cat([torch.full((3, rows.shape[1]), 1e6), rows[start:end]])
    return pooler(batch, hidden)


@pytest.mark.parametrize("kind", ["MEAN", "CLS", "LAST"])
def test_chunks_and_a_restart_count_every_row_once(kind):
    torch.manual_seed(0)
    prompt = list(range(3, 53))
    rows = torch.randn(len(prompt), 8)
    pooler = Pooler(PoolingConfig(kind, False), BLOCK)
    assert _chunk(pooler, prompt, rows, 0, 20) == []
    assert _chunk(pooler, prompt, rows, 20, 40) == []
    # preempted after 40 tokens; back with its first two blocks (32 tokens) cached: recomputes 32..50
    ((req, vector),) = _chunk(pooler, prompt, rows, 32, 50)
    want = {"MEAN": rows.mean(0), "CLS": rows[0], "LAST": rows[-1]}[kind]
    assert req.request_id == "r#0"
    torch.testing.assert_close(vector, want)
    assert not pooler._sums and not pooler._first  # nothing kept after the request is done


def test_finish_embedding_truncates_then_normalises():
    v = torch.tensor([3.0, 4.0, 12.0])
    assert finish_embedding(v, PoolingConfig("LAST", True), PoolingParams(dimensions=2)) == pytest.approx([0.6, 0.8])
    assert finish_embedding(v, PoolingConfig("LAST", False), PoolingParams()) == [3.0, 4.0, 12.0]
    assert finish_embedding(v, PoolingConfig("LAST", False), PoolingParams(normalize=True))[2] == pytest.approx(12 / 13)
