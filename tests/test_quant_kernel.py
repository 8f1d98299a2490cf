"""The quantized GEMM kernel against the dequantized weights, for every GGUF type it runs as stored.

The kernel quantizes each activation row to int8 per 32 elements (scale amax/127, round half to even), so the
tight oracle applies the same activation rounding in float64 and compares to ~float32 accumulation error; a second
check against the plain float32 product bounds the total error of the int8 activations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.benchmarks.gguf_writer import quantized
from pagedllm.quantization.tensor import KERNEL_TYPES, TYPE_IDS, QuantTensor, kernel_available

pytestmark = pytest.mark.skipif(not kernel_available(), reason="the C++ kernels could not be built")

TYPES = [name for name, _, _ in KERNEL_TYPES.values()]


def _weight(qtype: str, rows: int, cols: int, seed: int) -> QuantTensor:
    raw = quantized(np.random.default_rng(seed), rows, cols, qtype, 0.05)
    return QuantTensor(torch.from_numpy(np.ascontiguousarray(raw)), TYPE_IDS[qtype], cols)


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds it: per 32-block codes round(x * 127 / amax), times amax / 127."""
    m, k = x.shape
    pad = (-k) % 32
    xb = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(xb * inv)
    return (codes.double() * (amax / 127.0).double()).view(m, -1)[:, :k]


def _cols(qtype: str) -> int:
    # 32-block types: 288 = 4.5 x 64 exercises the zero padding to whole 64-element chunks
    return 512 if KERNEL_TYPES[TYPE_IDS[qtype]][1] == 256 else 288


@pytest.mark.parametrize("qtype", TYPES)
def test_matches_dequantized_weights(qtype):
    k = _cols(qtype)
    w = _weight(qtype, 40, k, seed=1)
    ref_w = w.dequantize().double()
    torch.manual_seed(0)
    for m in (1, 3, 6):
        x = torch.randn(m, k)
        got = w.matmul(x)
        tight = _quantized_activations(x) @ ref_w.T
        torch.testing.assert_close(got.double(), tight, rtol=1e-5, atol=1e-5 * float(tight.abs().max()))
        loose = x.double() @ ref_w.T  # the int8 activations cost ~1% of the output scale
        assert float((got.double() - loose).abs().max()) < 0.03 * float(loose.abs().max())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
def test_rows_are_batch_invariant(qtype):
    """A row gives the same bits alone and anywhere in batches of any size (bf16 in, bf16 and fp32 out)."""
    k = _cols(qtype)
    w = _weight(qtype, 37, k, seed=2)
    torch.manual_seed(1)
    x = torch.randn(9, k).bfloat16()
    full = w.matmul(x)
    full32 = w.matmul(x, torch.empty(9, 37))
    for m in (1, 2, 4, 5, 8):
        for i in range(m):
            part = w.matmul(x[:m].contiguous())
            assert torch.equal(part[i], full[i])
    assert torch.equal(w.matmul(x[4:5].contiguous())[0], full[4])
    assert torch.equal(full32.bfloat16(), full)


def test_writes_into_a_column_slice():
    w = _weight("Q8_0", 24, 256, seed=3)
    x = torch.randn(3, 256)
    out = torch.full((3, 40), 7.0)
    w.matmul(x, out[:, 8:32])
    torch.testing.assert_close(out[:, 8:32], w.matmul(x))
    assert torch.all(out[:, :8] == 7.0) and torch.all(out[:, 32:] == 7.0)


def test_rejects_a_wrong_row_size():
    w = _weight("Q4_0", 8, 256, seed=4)
    with pytest.raises(RuntimeError, match="row bytes"):
        QuantTensor(w.data[:, :-2].contiguous(), w.qtype, 256).matmul(torch.randn(1, 256))
