"""The batched LoRA kernel (csrc/lora.cpp: lora_apply) against torch on fresh random inputs: every row gets its own
slot's B A x (base-model rows nothing), for fp32 and bf16 rows, with shards and unused ranks; a row's result is
bitwise the same alone, in any batch, and whichever slot its adapter sits in."""

from __future__ import annotations

import pytest
import torch
from tiny_models import fresh_seed

from pagedllm.kernels import kernel_op
from pagedllm.lora.layers import LoRAStack, lora_batch, make_batch

OUTPUT_SIZES = [48, 16, 16]  # q|k|v-like shards
IN, SLOTS, MAX_RANK = 40, 3, 8


@pytest.fixture(scope="module")
def op():
    op = kernel_op("lora_apply")
    if op is None:
        pytest.skip("the C++ kernels are not built")
    return op


def random_adapter(gen: torch.Generator, shards: list[int], rank: int) -> dict:
    return {k: (torch.randn(rank, IN, generator=gen), torch.randn(OUTPUT_SIZES[k], rank, generator=gen))
            for k in shards}


def reference(out: torch.Tensor, x: torch.Tensor, adapters: list[dict | None]) -> torch.Tensor:
    """out[i] + B A x[i] per shard, in float64, rounded once to out's dtype."""
    want = out.double().clone()
    for i, ad in enumerate(adapters):
        for k, (a, b) in (ad or {}).items():
            col = sum(OUTPUT_SIZES[:k])
            want[i, col:col + b.shape[0]] += b.double() @ (a.double() @ x[i].double())
    return want.to(out.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_apply_equals_torch_and_is_row_invariant(op, dtype):
    gen = torch.Generator().manual_seed(fresh_seed())
    stack = LoRAStack(IN, OUTPUT_SIZES, SLOTS, MAX_RANK)
    adapters = [random_adapter(gen, [0, 2], 8), random_adapter(gen, [1], 3), random_adapter(gen, [0, 1, 2], 5)]
    for s, ad in enumerate(adapters):
        stack.set_slot(s, ad)
    rows = 23
    slots = torch.randint(-1, SLOTS, (rows,), generator=gen).tolist()
    x = torch.randn(rows, IN, generator=gen).to(dtype)
    base = torch.randn(rows, sum(OUTPUT_SIZES), generator=gen).to(dtype)
    with lora_batch(make_batch(slots)):
        got = stack(x, base.clone())
    want = reference(base, x, [adapters[s] if s >= 0 else None for s in slots])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for i in range(rows):  # base rows untouched; every row alone = in the batch, bitwise
        if slots[i] < 0:
            assert torch.equal(got[i], base[i])
        with lora_batch(make_batch([slots[i]])):
            alone = stack(x[i:i + 1], base[i:i + 1].clone())
        assert torch.equal(alone[0], got[i])
    moved = LoRAStack(IN, OUTPUT_SIZES, SLOTS, MAX_RANK)  # the same adapters in other slots
    order = [2, 0, 1]
    for s, ad in enumerate(adapters):
        moved.set_slot(order[s], ad)
    with lora_batch(make_batch([order[s] if s >= 0 else -1 for s in slots])):
        assert torch.equal(moved(x, base.clone()), got)


def test_emptied_slot_adds_nothing(op):
    gen = torch.Generator().manual_seed(fresh_seed())
    stack = LoRAStack(IN, OUTPUT_SIZES, SLOTS, MAX_RANK)
    stack.set_slot(1, random_adapter(gen, [0], 4))
    stack.set_slot(1, None)
    x, base = torch.randn(4, IN, generator=gen), torch.randn(4, sum(OUTPUT_SIZES), generator=gen)
    with lora_batch(make_batch([1, 1, -1, 1])):
        assert torch.equal(stack(x, base.clone()), base)
