"""The corpus: each class of damaged or hostile GGUF found by the probe of issue 31, as a regression test. Every one
raises InvalidModelError naming the file and the field, fast and small (check_variant's bounds), or, where the
file is in fact valid, loads as the original."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from pagedllm_bench.fuzz_gguf import check_variant, load_summary, map_fields, peak_rss, write_tiny_gguf

from pagedllm.model.errors import InvalidModelError
from pagedllm.model.gguf_reader import read_gguf
from pagedllm.model.loader import load_model


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("corpus") / "orig.gguf")
    write_tiny_gguf(path, seed=1)
    with open(path, "rb") as f:
        return f.read(), load_summary(path)


def _field(data: bytes, kind: str, owner: str, index: int = 0):
    return [f for f in map_fields(data).fields if f.kind == kind and f.owner == owner][index]


def _set(data: bytes, edits: list[tuple[str, str, object]]) -> bytes:
    """Set fields (kind, owner, value), each packed in its own encoding; a value of another type is packed as
    the field's encoding allows (a float into a float field, an int wrapped to the field's width)."""
    out = bytearray(data)
    for kind, owner, value in edits:
        f = _field(data, kind, owner)
        if f.fmt in ("<f", "<d"):
            struct.pack_into(f.fmt, out, f.pos, float(value))
        else:
            bits = struct.calcsize(f.fmt) * 8
            struct.pack_into(f.fmt.upper(), out, f.pos, int(value) % (1 << bits))
    return bytes(out)


def _rename(data: bytes, kind: str, owner: str, new: str) -> bytes:
    assert len(new) == len(owner)
    f = _field(data, kind, owner)
    out = bytearray(data)
    out[f.pos + 8:f.pos + 8 + len(owner)] = new.encode()
    return bytes(out)


def _offset(data: bytes, name: str) -> int:
    return struct.unpack_from("<Q", data, _field(data, "offset", name).pos)[0]


def _expect_invalid(tmp_path, original, variant: bytes, *fragments: str) -> str:
    _, ref = original
    path = tmp_path / "variant.gguf"
    path.write_bytes(variant)
    outcome = check_variant(str(path), ref)
    assert outcome.result == "invalid", f"loaded: expected an error about {fragments}"
    for fragment in fragments:
        assert fragment in outcome.message, (fragment, outcome.message)
    return outcome.message


Q = "blk.0.attn_q.weight"
K = "blk.0.attn_k.weight"


def test_type_table_matches_the_gguf_package():
    from gguf.constants import GGML_QUANT_SIZES

    from pagedllm.quantization.types import GEOMETRY

    assert {t: (t.name, *size) for t, size in GGML_QUANT_SIZES.items()} == GEOMETRY


def test_unaligned_offset(tmp_path, original):
    data, _ = original
    _expect_invalid(tmp_path, original, _set(data, [("offset", Q, _offset(data, Q) + 4)]), Q, "alignment")


def test_overlapping_and_all_zero_offsets(tmp_path, original):
    data, _ = original
    _expect_invalid(tmp_path, original, _set(data, [("offset", K, _offset(data, Q))]), K, "overlaps")
    names = [f.owner for f in map_fields(data).of("offset")]
    _expect_invalid(tmp_path, original, _set(data, [("offset", n, 0) for n in names]), "overlaps")


@pytest.mark.parametrize("align", [0, 3, 48, 1 << 31, (1 << 32) - 32])
def test_alignment_not_a_power_of_two(tmp_path, original, align):
    data, _ = original
    _expect_invalid(tmp_path, original, _set(data, [("value", "general.alignment", align)]), "general.alignment")


def test_negative_alignment(tmp_path, original):
    data, _ = original
    variant = _set(data, [("vtype", "general.alignment", 5), ("value", "general.alignment", -32)])  # int32
    _expect_invalid(tmp_path, original, variant, "general.alignment")


def test_duplicate_tensor_name_and_metadata_key(tmp_path, original):
    data, _ = original
    _expect_invalid(tmp_path, original, _rename(data, "tname", "blk.1.attn_q.weight", Q), Q, "duplicate")
    keys = [f.owner for f in map_fields(data).of("key")]
    a, b = next((a, b) for a in keys for b in keys if a != b and len(a) == len(b))
    _expect_invalid(tmp_path, original, _rename(data, "key", a, b), b, "duplicate")


@pytest.mark.parametrize("new_type", [0, 1, 2, 8, 30, 6, 12, 99])
def test_tensor_relabelled_with_another_type(tmp_path, original, new_type):
    data, _ = original
    info = read_gguf_bytes(tmp_path, data).tensors[Q]
    if info.ggml_type == new_type:
        pytest.skip("same type")
    msg = _expect_invalid(tmp_path, original, _set(data, [("ttype", Q, new_type)]))
    assert "tensor" in msg


def read_gguf_bytes(tmp_path, data: bytes):
    p = tmp_path / "orig-copy.gguf"
    p.write_bytes(data)
    return read_gguf(str(p))


@pytest.mark.parametrize("key", ["llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon"])
@pytest.mark.parametrize("value", [-1.0, 0.0, math.nan, math.inf, -math.inf])
def test_rope_theta_and_eps_finite_positive(tmp_path, original, key, value):
    data, _ = original
    _expect_invalid(tmp_path, original, _set(data, [("value", key, value)]), key)


@pytest.mark.parametrize("value", [1 << 40, 0, 3, 1 << 32 - 1])
def test_block_count_sane_and_consistent(tmp_path, original, value):
    data, _ = original
    _expect_invalid(tmp_path, original, _set(data, [("value", "llama.block_count", value)]), "llama.block_count")


@pytest.mark.parametrize("key,value", [("llama.attention.head_count", 0), ("llama.attention.head_count", 3),
                                       ("llama.attention.head_count_kv", 3), ("llama.embedding_length", 64),
                                       ("llama.embedding_length", 1 << 31), ("llama.feed_forward_length", 32),
                                       ("llama.context_length", 1 << 40), ("llama.vocab_size", 65),
                                       ("tokenizer.ggml.eos_token_id", 64),
                                       ("tokenizer.ggml.bos_token_id", (1 << 32) - 1)])
def test_dimensions_and_token_ids_checked(tmp_path, original, key, value):
    data, _ = original
    _expect_invalid(tmp_path, original, _set(data, [("value", key, value)]), key.rsplit(".", 1)[0])


@pytest.mark.parametrize("kind,owner,value", [
    ("count", "tensors", 1 << 60), ("count", "metadata", (1 << 64) - 1), ("arrlen", "tokenizer.ggml.tokens", 1 << 50),
    ("strlen", "tokenizer.chat_template", 1 << 62), ("dim", Q, 1 << 40), ("dim", Q, 0), ("ndim", Q, 9),
    ("arrlen", "tokenizer.ggml.scores", 63), ("vtype", "llama.block_count", 77)])
def test_counts_lengths_and_dims_checked(tmp_path, original, kind, owner, value):
    data, _ = original
    _expect_invalid(tmp_path, original, _set(data, [(kind, owner, value)]))


def test_truncated_anywhere_and_garbage_after(tmp_path, original):
    data, _ = original
    for cut in (3, 24, 100, len(data) // 3, len(data) - 33, len(data) - 1):
        _expect_invalid(tmp_path, original, data[:cut], "truncated")
    _expect_invalid(tmp_path, original, data + b"\0" * 64, "after the last tensor")


def test_nesting_bounded_and_arrays_are_views(tmp_path):
    import gguf

    deep = str(tmp_path / "deep.gguf")
    w = gguf.GGUFWriter(deep, "llama")
    w.add_array("x.deep", [[[1, 2]]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(InvalidModelError, match="x.deep.*nested"):
        read_gguf(deep)
    big = str(tmp_path / "big.gguf")  # a 64 MiB u8 array: a view of the mapping, not 64 M Python ints
    with open(big, "wb") as fh:
        fh.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 2))
        fh.write(_kv_string("general.architecture", "llama"))
        fh.write(struct.pack("<Q", 5) + b"x.big" + struct.pack("<IIQ", 9, 0, 64 << 20) + bytes(64 << 20))
    with peak_rss() as peak:
        f = read_gguf(big)
        arr = f.metadata["x.big"]
        assert isinstance(arr, np.ndarray) and len(arr) == 64 << 20 and not arr.flags.owndata
        copy = tmp_path / "vocab.gguf"
        f.write_vocabulary_copy(str(copy))  # what a tokenizer converter gets: not the stray array
        assert os.path.getsize(copy) < 1024
        assert peak() < 32 << 20


def _kv_string(key: str, value: str) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<IQ", 8, len(value)) + value.encode()


def test_version_and_magic(tmp_path, original):
    data, _ = original
    for version in (1, 4, 1 << 31):
        _expect_invalid(tmp_path, original, data[:4] + struct.pack("<I", version) + data[8:], "version")
    _expect_invalid(tmp_path, original, b"GGUX" + data[4:], "not a GGUF")


def test_fifo_and_devices_do_not_hang(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(InvalidModelError, match="not a regular file"):
        load_model(str(fifo), load_tokenizer=False)
    with pytest.raises(InvalidModelError, match="not a regular file"):
        load_model("/dev/zero", load_tokenizer=False)


def test_cli_prints_one_line(tmp_path, original):
    data, _ = original
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_set(data, [("value", "llama.block_count", 1 << 40)]))
    r = subprocess.run([sys.executable, "-m", "pagedllm.cli", "generate", "--model", str(bad), "hi"],
                       capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert str(bad) in lines[0] and "llama.block_count" in lines[0]


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 1 << 40), ("hidden_size", "64"),
                                       ("rms_norm_eps", float("nan")), ("rope_theta", -1.0),
                                       ("num_attention_heads", 0), ("vocab_size", None)])
def test_hf_config_checked_the_same_way(tmp_path, key, value):
    """config.json gets the same ranges (an HF directory is downloaded from strangers too)."""
    import json

    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
           "max_position_embeddings": 128, key: value}
    (tmp_path / "config.json").write_text(json.dumps(cfg, allow_nan=True))
    with pytest.raises(InvalidModelError, match=f"config.json: {key}"):
        load_model(str(tmp_path), load_tokenizer=False)
