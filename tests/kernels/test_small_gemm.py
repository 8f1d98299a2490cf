"""The small-batch bf16 GEMM kernel (decode-sized linears) against an fp32 matmul of the same bf16 inputs."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import dispatch
from pagedllm.model import layers

# the batch-dependent fast paths (batch-invariant mode, the default, does not use them)
pytestmark = pytest.mark.usefixtures("batch_dependent_kernels")


def kernel():
    op = dispatch.kernel_op("small_gemm_bf16")
    if op is None:
        pytest.skip("no avx512_bf16 small-GEMM kernel on this CPU")
    return op


@pytest.mark.parametrize("m,n,k", [(1, 3072, 576), (4, 960, 576), (2, 37, 100), (3, 5, 33), (1, 1, 1),
                                   (4, 129, 1536), (1, 513, 64)])
def test_matches_fp32_matmul(m, n, k):
    op = kernel()
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    op(out, x, w)
    ref = x.float() @ w.float().T
    # fp32 accumulation of exact bf16 products: only the final rounding to bf16 (and summation order) differ
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_linear_dispatch_uses_kernel_only_for_small_bf16_batches():
    kernel()
    g = torch.Generator().manual_seed(7)
    w = torch.randn(300, 128, generator=g).bfloat16()
    b = torch.randn(300, generator=g).bfloat16()
    for rows in (1, dispatch.small_gemm_max_rows(), dispatch.small_gemm_max_rows() + 1, 40):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        got = layers.linear(x, w, b)
        ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 300)
        assert torch.allclose(got.float(), ref, rtol=2e-2, atol=5e-2)
    x32 = torch.randn(2, 128, generator=g)
    assert torch.equal(layers.linear(x32, w.float()), torch.nn.functional.linear(x32, w.float()))
