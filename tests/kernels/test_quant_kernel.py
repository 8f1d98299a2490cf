"""The quantized GEMM kernel against the dequantized weights, for every GGUF type it runs as stored.

The kernel quantizes each activation row to int8 per 32 elements (scale amax/127, round half to even), so the
tight oracle applies the same activation rounding in float64 and compares to ~float32 accumulation error; a second
check against the plain float32 product bounds the total error of the int8 activations."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from tiny_models import fresh_seed

from pagedllm.kernels.dispatch import AMX, has, kernel_op, matrix_engine
from pagedllm.kernels.variants import VARIANT_ENV, build_variant, cpu_flags
from pagedllm.quantization.tensor import QuantTensor, kernel_available, pack_stacked, type_id
from pagedllm.quantization.types import BY_NAME, KERNEL_TYPES
from pagedllm.testing.gguf_writer import quantized

pytestmark = pytest.mark.skipif(not kernel_available(), reason="the C++ kernels could not be built")

# every type the kernel runs, as the file stores it and in its packed 16-row form
TYPES = [t.name for t in KERNEL_TYPES]
PACKED = TYPES
FORMS = [(t, False) for t in TYPES] + [(t, True) for t in PACKED]


def _weight(qtype: str, rows: int, cols: int, seed: int, packed: bool = False) -> QuantTensor:
    raw = quantized(np.random.default_rng(seed), rows, cols, qtype, 0.05)
    w = QuantTensor(torch.from_numpy(np.ascontiguousarray(raw)), type_id(qtype), cols)
    if packed:
        w = w.packed()
        assert w.is_packed and w.file_type == type_id(qtype)
    return w


def test_type_table_is_the_kernels():
    """types.py's rows are the C++ traits' geometry (quant_types.h), type for type, and every type packs."""
    table = kernel_op("quant_type_table")().tolist()
    assert [(i, b, n) for i, b, n, _ in table] == [(t.id, t.block, t.bytes) for t in KERNEL_TYPES]
    for _, _, nbytes, packed_bytes in table:  # at most Q3_K's 114 for 110: its 6-bit scales stored as bytes
        assert nbytes <= packed_bytes <= 1.04 * nbytes


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
    return 512 if BY_NAME[qtype].block == 256 else 288


@pytest.mark.parametrize("qtype,packed", FORMS)
def test_matches_dequantized_weights(qtype, packed):
    k = _cols(qtype)
    w = _weight(qtype, 48 if packed else 40, k, seed=1, packed=packed)
    ref_w = _weight(qtype, w.shape[0], k, seed=1).dequantize().double()  # the file's bytes through the oracle
    torch.manual_seed(0)
    for m in (1, 3, 6, 11):
        x = torch.randn(m, k)
        got = w.matmul(x)
        tight = _quantized_activations(x) @ ref_w.T
        torch.testing.assert_close(got.double(), tight, rtol=1e-5, atol=1e-5 * float(tight.abs().max()))
        loose = x.double() @ ref_w.T  # the int8 activations cost ~1% of the output scale
        assert float((got.double() - loose).abs().max()) < 0.03 * float(loose.abs().max())


@pytest.mark.parametrize("qtype,packed", [("Q4_0", False), ("Q4_K", False), ("Q6_K", False)] +
                         [(t, True) for t in PACKED])
def test_rows_are_batch_invariant(qtype, packed):
    """A row gives the same bits alone and anywhere in batches of any size (bf16 in, bf16 and fp32 out)."""
    k = _cols(qtype)
    n = 48 if packed else 37
    w = _weight(qtype, n, k, seed=2, packed=packed)
    torch.manual_seed(1)
    x = torch.randn(9, k).bfloat16()
    full = w.matmul(x)
    full32 = w.matmul(x, torch.empty(9, n))
    for m in (1, 2, 4, 5, 8):
        for i in range(m):
            part = w.matmul(x[:m].contiguous())
            assert torch.equal(part[i], full[i])
    assert torch.equal(w.matmul(x[4:5].contiguous())[0], full[4])
    assert torch.equal(full32.bfloat16(), full)


@pytest.mark.parametrize("qtype", PACKED)
def test_rows_past_the_row_chunk_are_batch_invariant(qtype):
    """A long prompt's rows go through the packed GEMM in chunks of rows (quant_packed.cpp's kRowChunk): rows on
    either side of a chunk boundary and in the last, partial tile equal the same rows computed alone."""
    k = _cols(qtype)
    w = _weight(qtype, 32, k, seed=8, packed=True)
    torch.manual_seed(2)
    x = torch.randn(141, k)
    full = w.matmul(x)
    for i in (0, 127, 128, 135, 136, 140):
        assert torch.equal(w.matmul(x[i:i + 1].contiguous())[0], full[i])


@pytest.mark.skipif(not kernel_available() or not has(AMX), reason="needs a CPU with AMX (and the OS's tile state)")
@pytest.mark.parametrize("qtype", PACKED)
def test_the_matrix_engine_computes_the_vnni_paths_bits(qtype):
    """On a CPU with AMX the packed GEMM runs whole 16-row tiles on the tile unit (tdpbssd) and the rest on VNNI:
    the tile sums are the same integers and their scaling the same float steps, so every row equals the VNNI
    path's and the row computed alone, bitwise, across chunk boundaries, for bf16 and fp32 activations."""
    seed = fresh_seed()
    k = _cols(qtype) * 2
    w = _weight(qtype, 48, k, seed=seed, packed=True)
    gen = torch.Generator().manual_seed(seed)
    for m, dtype in ((16, torch.float32), (47, torch.bfloat16), (150, torch.float32)):
        x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4).to(dtype)
        tiles = w.matmul(x)
        with matrix_engine(False):
            vnni = w.matmul(x)
        assert torch.equal(tiles, vnni), f"seed {seed}, {m} rows"
        for i in sorted({0, 15, min(16, m - 1), m - 1}):
            assert torch.equal(w.matmul(x[i:i + 1].contiguous())[0], tiles[i]), f"seed {seed}, row {i} of {m}"


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


@pytest.mark.parametrize("qtype", PACKED)
def test_packed_form_holds_the_files_values(qtype):
    """Repacking moves bytes, it changes no weight: the packed rows dequantize to exactly the file's values, with
    the file's bytes (a few % more where the file packs 6-bit scales), and the raw and packed products agree to
    float32 rounding (they sum in another order)."""
    k = _cols(qtype)
    raw, packed = _weight(qtype, 32, k, seed=5), _weight(qtype, 32, k, seed=5, packed=True)
    assert torch.equal(packed.dequantize(), raw.dequantize().float())
    ids = torch.tensor([31, 0, 17, 17, 5])
    assert torch.equal(packed.embedding(ids, torch.float32), raw.embedding(ids, torch.float32))
    assert packed.nbytes <= 1.04 * raw.nbytes  # Q3_K: 114 bytes for the file's 110
    x = torch.randn(5, k)
    torch.testing.assert_close(packed.matmul(x), raw.matmul(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", PACKED)
def test_stacked_packing_is_the_parts_packed_one_after_another(qtype):
    """A fused q|k|v packs its shards straight into one matrix: the same bytes as packing each and stacking."""
    k = _cols(qtype)
    parts = [_weight(qtype, rows, k, seed=7 + i) for i, rows in enumerate((48, 16, 32))]
    stacked = pack_stacked(parts)
    assert torch.equal(stacked.data, torch.cat([p.packed().data for p in parts]))
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize().float() for p in parts]))
    with pytest.raises(ValueError, match="one type"):
        pack_stacked([parts[0], _weight("Q8_0" if qtype != "Q8_0" else "Q4_0", 16, k, seed=9)])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q6_K", "MXFP4"])
def test_a_table_of_partial_groups_packs_with_zero_rows(qtype):
    """A matrix whose rows do not fill 16-row groups (Granite's 49,159-token vocabulary as a tied head) packs with
    zero rows added: its shape, its products (into a new tensor or a given one) and its rows are the matrix's."""
    k = _cols(qtype)
    plain = _weight(qtype, 40, k, seed=6)
    packed = plain.packed()
    assert packed.is_packed and packed.shape == (40, k) and packed.data.shape[0] == 48
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(fresh_seed()))
    got = packed.matmul(x)
    ref = _quantized_activations(x) @ plain.dequantize().double().T
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    out = torch.empty(3, 40)
    assert packed.matmul(x, out) is out and torch.equal(out, got)
    ids = torch.tensor([0, 17, 39])
    assert torch.equal(packed.embedding(ids, torch.float32), plain.embedding(ids, torch.float32))
    with pytest.raises(ValueError, match="packed"):
        packed.rows(torch.tensor([1]))


def _mxfp4_every_scale(rows: int, cols: int, seed: int, top: int) -> QuantTensor:
    """MXFP4 blocks of random codes whose scale bytes cover 0..top (0 and 1: subnormal scales), each row a band of
    neighbouring ones, so that no row's products swamp its small scales with large ones."""
    blocks = np.random.default_rng(seed).integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
    band = -(-(top + 1) // rows)
    blocks[..., 0] = np.minimum(np.arange(rows)[:, None] * band + np.arange(cols // 32) % band, top)
    return QuantTensor(torch.from_numpy(blocks.reshape(rows, -1)), type_id("MXFP4"), cols)


def test_mxfp4_packed_rows_hold_every_scale():
    """The packed form decodes each e8m0 scale as the file does (subnormal ones included): the same weights (to
    2^(252 - 128): past it the largest codes overflow)."""
    w = _mxfp4_every_scale(32, _cols("MXFP4"), fresh_seed(), top=252)
    assert torch.equal(w.packed().dequantize(), w.dequantize())


_PORTABLE_SIDE = """
import sys, torch
from pagedllm.quantization.tensor import QuantTensor
case = torch.load(sys.argv[1])
out = {name: QuantTensor(data, qtype, cols).packed().matmul(x)
       for name, (data, qtype, cols, x) in case.items()}
torch.save(out, sys.argv[2])
"""


def test_the_portable_build_computes_the_same_bits(tmp_path):
    """The packed GEMM's portable path (the build for CPUs without AVX2) does the vector paths' arithmetic (VNNI's
    vpdpbusd, AVX2's vpmaddubsw) in the same order: the same weights and activations give the same bits from this
    build and the portable one. The other
    build runs in a subprocess ($PAGEDLLM_KERNEL_VARIANT: one extension per process); it is cached, so the
    variant tests reuse it."""
    if build_variant(cpu_flags(), os.environ.get(VARIANT_ENV) or None)[0] == "portable":
        pytest.skip("this process already runs the portable build")
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    case, ours = {}, {}
    for i, qtype in enumerate(TYPES):
        w = _weight(qtype, 32, _cols(qtype), seed + i)
        # 25 rows: a 16-row tile (AMX's, where the CPU has it), an 8-row tile and a 1-row tail
        x = torch.randn(25, w.shape[1], generator=gen)
        case[qtype] = (w.data, w.qtype, w.shape[1], x)
        ours[qtype] = w.packed().matmul(x)
    # MXFP4 scales 2^-128..2^63: the vector paths decode the e8m0 bytes themselves, subnormal ones included
    w = _mxfp4_every_scale(32, _cols("MXFP4"), seed, top=191)
    x = torch.randn(25, w.shape[1], generator=gen)
    case["MXFP4 every scale"] = (w.data, w.qtype, w.shape[1], x)
    ours["MXFP4 every scale"] = w.packed().matmul(x)
    torch.save(case, tmp_path / "case.pt")
    env = {**os.environ, VARIANT_ENV: "portable"}
    subprocess.run([sys.executable, "-c", _PORTABLE_SIDE, str(tmp_path / "case.pt"), str(tmp_path / "out.pt")],
                   env=env, check=True, timeout=1800)
    theirs = torch.load(tmp_path / "out.pt")
    differ = [t for t in case if not torch.equal(ours[t], theirs[t])]
    assert not differ, f"seed {seed}: the portable build differs on {differ}"


@pytest.mark.skipif(not kernel_available(), reason="needs the C++ extension")
def test_huge_page_arena_hands_out_disjoint_memory_that_outlives_its_neighbours():
    """Packed weights are carved one after another from shared 2 MiB-page chunks (huge_pages.cpp): every tensor
    keeps its own bytes while others, small and larger than a chunk, come and go around it."""
    empty = kernel_op("empty_huge_paged")
    gen = torch.Generator().manual_seed(11)
    sizes = [(1, 1), (3, 1000), (16, 4096), (40 << 10, 1024), (5, 77), (70 << 10, 1024), (2, 3)]
    kept = []
    for i, (rows, cols) in enumerate(sizes):
        t = empty(rows, cols)
        assert t.shape == (rows, cols) and t.dtype == torch.uint8 and t.data_ptr() % 64 == 0
        t.copy_(torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen))
        kept.append((t, t.clone()))
        if i % 2:
            kept.pop(0)  # drop an older one: its chunk may be unmapped only once nothing else holds it
        for tensor, want in kept:
            assert torch.equal(tensor, want)
