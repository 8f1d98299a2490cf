"""GGUF fuzzing, shared by the tests (tests/model/test_fuzz_gguf.py, with hypothesis) and
`pagedllm bench fuzz`: a tiny valid GGUF, a map of where each of its header fields lies, mutations of every
kind a hostile or damaged file shows (bit flips, truncation, and edits of counts, lengths, dimensions, types,
offsets, names, alignment and values), and the oracle: a variant either loads and matches the original (same
shapes and bit-identical weights: only what a value field says may differ), or raises InvalidModelError,
within a CPU-time and memory bound."""

from __future__ import annotations

import contextlib
import math
import random
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

V, H, FFN, LAYERS, HEADS, KV_HEADS = 64, 32, 64, 2, 4, 2
SHAPE_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                "vocab_size", "tie_word_embeddings", "qkv_bias", "qk_norm", "architecture")
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def write_tiny_gguf(path: str, seed: int = 0) -> None:
    """A tiny Llama (vocabulary V with merges, chat template, explicit general.alignment) in F32/F16/Q8_0."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(32)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_token_types([1] * V)
    w.add_token_scores([float(-i) for i in range(V)])
    w.add_token_merges(["t 1", "t 2"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    kinds = [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0]

    def add(name: str, *shape: int) -> None:
        arr = (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
        kind = kinds[int(rng.integers(3))] if len(shape) == 2 else kinds[0]
        if kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        elif kind == gguf.GGMLQuantizationType.Q8_0:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", V, H)
    add("output_norm.weight", H)
    kv = H // HEADS * KV_HEADS
    for i in range(LAYERS):
        for name, shape in (("attn_norm", (H,)), ("ffn_norm", (H,)), ("attn_q", (H, H)), ("attn_k", (kv, H)),
                            ("attn_v", (kv, H)), ("attn_output", (H, H)), ("ffn_gate", (FFN, H)),
                            ("ffn_up", (FFN, H)), ("ffn_down", (H, FFN))):
            add(f"blk.{i}.{name}.weight", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@dataclass
class Field:
    """One header field of a valid file: where it is, how it is encoded, what it belongs to."""

    kind: str  # count | key | vtype | value | strlen | arrlen | tname | ndim | dim | ttype | offset
    pos: int
    fmt: str  # struct format of the field at pos
    owner: str = ""  # the key or tensor name


@dataclass
class FieldMap:
    fields: list[Field] = field(default_factory=list)
    data_start: int = 0

    def of(self, *kinds: str) -> list[Field]:
        return [f for f in self.fields if f.kind in kinds]


def map_fields(data: bytes) -> FieldMap:
    """Where each header field of a valid GGUF lies (an independent walk, not the reader under test)."""
    m, pos = FieldMap(), 8
    m.fields += [Field("count", 8, "<Q", "tensors"), Field("count", 16, "<Q", "metadata")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(kind: str, owner: str = "") -> tuple[str, int]:
        n = struct.unpack_from("<Q", data, pos)[0]
        m.fields.append(Field(kind, pos, "<Q", owner))
        return data[pos + 8:pos + 8 + n].decode(), pos + 8 + n

    def value(vtype: int, owner: str, at: int) -> int:
        nonlocal pos
        pos = at
        if vtype in _SCALAR:
            m.fields.append(Field("value", pos, _SCALAR[vtype], owner))
            return pos + struct.calcsize(_SCALAR[vtype])
        if vtype == 8:
            return string("strlen", owner)[1]
        etype, n = struct.unpack_from("<IQ", data, pos)
        m.fields += [Field("vtype", pos, "<I", owner), Field("arrlen", pos + 4, "<Q", owner)]
        at = pos + 12
        for _ in range(n):
            at = value(etype, owner, at)
        return at

    for _ in range(n_kv):
        key, pos = string("key")
        m.fields[-1].owner = key
        m.fields.append(Field("vtype", pos, "<I", key))
        pos = value(struct.unpack_from("<I", data, pos)[0], key, pos + 4)
    for _ in range(n_tensors):
        name, pos = string("tname")
        m.fields[-1].owner = name
        ndim = struct.unpack_from("<I", data, pos)[0]
        m.fields.append(Field("ndim", pos, "<I", name))
        m.fields += [Field("dim", pos + 4 + 8 * d, "<Q", name) for d in range(ndim)]
        pos += 4 + 8 * ndim
        m.fields += [Field("ttype", pos, "<I", name), Field("offset", pos + 4, "<Q", name)]
        pos += 12
    m.data_start = -(-pos // 32) * 32
    return m


# values a hostile file puts in a field, per encoding
_INTS = [0, 1, 2, 3, 7, 31, 33, 64, 255, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 40, (1 << 63) - 1,
         (1 << 64) - 1]
_FLOATS = [0.0, -0.0, -1.0, 1e-30, 1e30, float("nan"), float("inf"), float("-inf"), 3.4e38]


def _edit(data: bytearray, f: Field, rng: random.Random) -> None:
    size = struct.calcsize(f.fmt)
    if f.fmt in ("<f", "<d"):
        v = rng.choice(_FLOATS)
        struct.pack_into(f.fmt, data, f.pos, v)
        return
    bits = size * 8
    old = struct.unpack_from(f.fmt, data, f.pos)[0]
    choice = rng.random()
    if choice < 0.5:
        v = rng.choice(_INTS)
    elif choice < 0.8:
        v = int(old) + rng.choice([-2, -1, 1, 2, 32, -32])
    else:
        v = rng.getrandbits(bits)
    fmt = f.fmt.upper() if f.fmt not in ("<?",) else "<B"
    struct.pack_into(fmt, data, f.pos, v % (1 << bits))


def _copy_name(data: bytearray, fm: FieldMap, rng: random.Random, kind: str) -> bool:
    """Rename one key or tensor to another of the same length (a duplicate, or a swap of roles)."""
    names = fm.of(kind)
    pairs = [(a, b) for a in names for b in names if a is not b and len(a.owner) == len(b.owner)]
    if not pairs:
        return False
    a, b = rng.choice(pairs)
    data[a.pos + 8:a.pos + 8 + len(a.owner)] = b.owner.encode()
    return True


MUTATIONS = ("bitflip", "truncate", "edit", "rename_key", "rename_tensor", "offsets", "garbage_tail")


def mutate(original: bytes, rng: random.Random, kind: str | None = None) -> tuple[bytes, str]:
    """A damaged or hostile variant of `original` and a description of what was done."""
    fm = map_fields(original)
    data = bytearray(original)
    kind = kind or rng.choice(MUTATIONS)
    if kind == "bitflip":
        flips = [rng.randrange(fm.data_start * 8) for _ in range(rng.choice([1, 1, 2, 3, 8]))]
        for bit in flips:
            data[bit // 8] ^= 1 << (bit % 8)
        return bytes(data), f"bitflip {flips}"
    if kind == "truncate":
        cut = rng.randrange(len(original))
        return original[:cut], f"truncate at {cut} of {len(original)}"
    if kind == "garbage_tail":
        return original + bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200))), "garbage tail"
    if kind in ("rename_key", "rename_tensor"):
        if _copy_name(data, fm, rng, "key" if kind == "rename_key" else "tname"):
            return bytes(data), kind
        kind = "edit"
    if kind == "offsets":
        offsets = fm.of("offset")
        a, b = rng.sample(offsets, 2)
        how = rng.choice(["same", "swap", "zero", "unaligned"])
        va, vb = (struct.unpack_from("<Q", original, x.pos)[0] for x in (a, b))
        new = {"same": (vb, vb), "swap": (vb, va), "zero": (0, 0), "unaligned": (va + rng.randint(1, 31), vb)}[how]
        struct.pack_into("<Q", data, a.pos, new[0])
        struct.pack_into("<Q", data, b.pos, new[1])
        return bytes(data), f"offsets {how} {a.owner} {b.owner}"
    kinds = sorted({f.kind for f in fm.fields})  # a kind first: array elements would swamp the rest
    edits = [rng.choice(fm.of(rng.choice(kinds))) for _ in range(rng.choice([1, 1, 2, 3]))]
    for f in edits:
        _edit(data, f, rng)
    return bytes(data), "edit " + ", ".join(f"{f.kind}@{f.pos}({f.owner})" for f in edits)


@dataclass
class Reference:
    """What the original file loads to."""

    config: dict
    weights: dict


def load_summary(path: str) -> Reference:
    """Load (dequantized, no tokenizer) and summarise; exceptions propagate."""
    import dataclasses

    from pagedllm.model.loader import load_model

    loaded = load_model(path, "float32", attention_backend="reference", load_tokenizer=False, quantization="none")
    weights = {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}
    return Reference(dataclasses.asdict(loaded.config), weights)


@contextlib.contextmanager
def peak_rss() -> Iterator[Callable[[], int]]:
    """Bytes the process's peak RSS rose by inside the block (Linux: /proc/self/clear_refs resets the peak;
    elsewhere the peak of Python and numpy allocations, by tracemalloc)."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = status("VmRSS:")
    except OSError:
        import tracemalloc

        tracemalloc.start()
        try:
            yield lambda: tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return
    yield lambda: status("VmHWM:") - base


@dataclass
class Outcome:
    result: str  # "loaded" | "invalid"
    cpu_seconds: float
    peak_bytes: int
    message: str = ""


class OracleFailure(AssertionError):
    pass


def check_variant(path: str, ref: Reference, cpu_limit: float = 2.0, memory_limit: int = 200 << 20) -> Outcome:
    """Load the variant at `path`: it must match `ref` or raise InvalidModelError, within the limits (thread CPU
    time: a loaded machine does not make it fail; peak RSS growth). OracleFailure says what went wrong."""
    from pagedllm.model.errors import InvalidModelError

    t0 = time.thread_time()
    with peak_rss() as peak:
        try:
            got = load_summary(path)
        except InvalidModelError as e:
            outcome = Outcome("invalid", 0.0, 0, str(e))
        except Exception as e:
            raise OracleFailure(f"not an InvalidModelError: {type(e).__name__}: {e}") from e
        else:
            outcome = Outcome("loaded", 0.0, 0)
            _compare(got, ref)
        outcome.peak_bytes = peak()
    outcome.cpu_seconds = time.thread_time() - t0
    if outcome.result == "invalid" and path not in outcome.message:
        raise OracleFailure(f"the message does not name the file: {outcome.message}")
    if outcome.cpu_seconds > cpu_limit or outcome.peak_bytes > memory_limit:
        raise OracleFailure(f"{outcome.result} took {outcome.cpu_seconds:.2f} s of CPU and "
                            f"{outcome.peak_bytes >> 20} MiB")
    return outcome


def _compare(got: Reference, ref: Reference) -> None:
    import torch

    for name in SHAPE_FIELDS:
        if got.config[name] != ref.config[name]:
            raise OracleFailure(f"loaded with {name}={got.config[name]} (original {ref.config[name]})")
    if got.weights.keys() != ref.weights.keys():
        raise OracleFailure("loaded with other parameters than the original")
    for k, v in got.weights.items():
        if v.shape != ref.weights[k].shape or v.dtype != ref.weights[k].dtype or not torch.equal(v, ref.weights[k]):
            raise OracleFailure(f"loaded with different weights in {k}")
