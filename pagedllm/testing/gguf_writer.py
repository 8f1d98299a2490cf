"""Random-weight GGUF files of a given shape and quantization type (benchmark models and test fixtures).

Weights are random normals quantized with `gguf.quants.quantize` where the gguf package has a quantizer (F32,
F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), and with `quantize_mxfp4` (llama.cpp's reference quantizer) for MXFP4.
The package has no K-quant or IQ4 quantizer, so those tensors are written as random but well-formed blocks (random
codes, sub-scales and mins, super-scales chosen so that the weights have about the same spread as the normals): for
a random-weight model either is as good.

Q3_K_M, Q4_K_M and Q5_K_M are typed tensor by tensor as llama.cpp's llama-quantize types them
(`llama_tensor_get_type`):
- Q4_K_M and Q5_K_M: Q6_K for the output head (or the tied embedding), for attn_v and ffn_down of the layers its
  use_more_bits picks, Q4_K / Q5_K elsewhere;
- Q3_K_M: Q6_K for the head, Q5_K for attn_v of the first two layers and ffn_down of the first sixteenth, Q4_K for
  the other attn_v, ffn_down and every attn_output, Q3_K elsewhere;
- both with llama-quantize's fallbacks where rows are not whole 256-blocks (Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K ->
  Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL; an output head -> Q8_0).
A single-type file (MXFP4 too) is typed as `llama-quantize --pure` would (every matrix, fallbacks aside). MXFP4_MOE
is llama-quantize's type of gpt-oss's files: experts MXFP4, every other matrix Q8_0. Large MXFP4 tensors are written
as random well-formed blocks (quantizing takes ~70 ns a weight: 20 minutes for gpt-oss-20b's experts).
The vocabulary of a shape (151,936 for Qwen2.5) pads the embedded tokenizer's with unused tokens: a real prompt
never samples them, but every decode step reads their rows of the output head.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pagedllm.quantization.types import BY_NAME, FLOAT_TYPES

FILE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
              "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4", "Q3_K_M", "Q4_K_M", "Q5_K_M", "MXFP4_MOE")
# types gguf.quants has no quantizer for: written as random well-formed blocks
RANDOM_BLOCK_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
RANDOM_MXFP4_MIN = 1 << 22  # MXFP4 tensors of this many weights or more: random blocks (quantizing takes ~70 ns each)


@dataclass(frozen=True)
class ModelShape:
    arch: str  # GGUF architecture: llama | qwen2 | qwen3moe | phi3 | granite | smollm3 | gpt-oss
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = 49152  # the embedded SmolLM2 tokenizer's; a larger one is padded with unused tokens
    tied: bool = False
    rope_theta: float = 10000.0
    eps: float = 1e-5
    context: int = 4096
    experts: int = 0  # a mixture of experts: experts per layer (every layer sparse), `experts_used` per token
    experts_used: int = 0
    expert_ffn: int = 0  # one expert's width
    qk_norm: bool = False  # per-head q/k RMSNorm (Qwen3)
    rotary_dim: int = 0  # the dims of each head RoPE rotates (Phi-4-mini: 96 of 128); 0: all
    # Granite's (embedding, residual, attention, logit) multipliers
    multipliers: tuple[float, float, float, float] | None = None
    sliding_window: int = 0  # gpt-oss: every other layer (the even ones) attends to this many tokens
    yarn: tuple[float, int] | None = None  # YaRN's (factor, original context)

    @property
    def fused(self) -> bool:
        """q|k|v in one attn_qkv and gate|up in one ffn_up (Phi-3's layout)."""
        return self.arch == "phi3"

    def as_llama(self) -> ModelShape:
        """The same widths as a plain Llama (full rotary, no multipliers): the baseline a family is held to."""
        return replace(self, arch="llama", rotary_dim=0, multipliers=None)


_QWEN = {"tied": True, "rope_theta": 1e6, "eps": 1e-6, "vocab": 151936}
_LLAMA3 = {"tied": True, "rope_theta": 5e5, "vocab": 128256}
SHAPES = {
    "tinyllama-1.1b": ModelShape("llama", 22, 2048, 5632, 32, 4, 64),
    "qwen2.5-0.5b": ModelShape("qwen2", 24, 896, 4864, 14, 2, 64, **_QWEN),
    "qwen2.5-1.5b": ModelShape("qwen2", 28, 1536, 8960, 12, 2, 128, **_QWEN),
    "qwen2.5-3b": ModelShape("qwen2", 36, 2048, 11008, 16, 2, 128, **_QWEN),
    "llama-3.2-1b": ModelShape("llama", 16, 2048, 8192, 32, 8, 64, **_LLAMA3),
    "llama-3.2-3b": ModelShape("llama", 28, 3072, 8192, 24, 8, 128, **_LLAMA3),
    # mixtures of experts (`--layers N` keeps the widths with fewer layers)
    "qwen3-30b-a3b": ModelShape("qwen3moe", 48, 2048, 6144, 32, 4, 128, vocab=151936, rope_theta=1e6, eps=1e-6,
                                context=40960, experts=128, experts_used=8, expert_ffn=768, qk_norm=True),
    # dense families with their own parts (each has a Llama twin of the same widths: ModelShape.as_llama)
    "phi-4-mini": ModelShape("phi3", 32, 3072, 8192, 24, 8, 128, vocab=200064, tied=True, rope_theta=1e4,
                             context=131072, rotary_dim=96),
    "granite-3.3-2b": ModelShape("granite", 40, 2048, 8192, 32, 8, 64, vocab=49159, tied=True, rope_theta=1e7,
                                 context=131072, multipliers=(12.0, 0.22, 0.015625, 8.0)),
    "smollm3-3b": ModelShape("smollm3", 36, 2048, 11008, 16, 4, 128, vocab=128256, tied=True, rope_theta=5e6,
                             eps=1e-6, context=65536),
    # gpt-oss: attention and expert biases, sinks, windows of 128 on every other layer, YaRN
    "gpt-oss-20b": ModelShape("gpt-oss", 24, 2880, 2880, 64, 8, 64, vocab=201088, rope_theta=150000.0,
                              context=131072, experts=32, experts_used=4, expert_ffn=2880, sliding_window=128,
                              yarn=(32.0, 4096)),
    "mixtral-8x7b": ModelShape("llama", 32, 4096, 14336, 32, 8, 128, vocab=32000, rope_theta=1e6,
                               context=32768, experts=8, experts_used=2, expert_ffn=14336),
}
# each family's Llama twin of the same widths: the baseline its decode speed is held to
SHAPES |= {f"{name}-as-llama": shape.as_llama() for name, shape in list(SHAPES.items())
           if shape.arch in ("phi3", "granite", "smollm3")}
LONGROPE_ORIGINAL = 4096  # a Phi-3 shape longer than this has LongRoPE factors switching here (Phi-4-mini's)
# llama-quantize's fallbacks for rows that are not whole blocks of the chosen type
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}
MIXES = {"Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}  # mixed file types and their default tensor type
# llama-quantize's MXFP4_MOE (gpt-oss's files): experts MXFP4, every other matrix Q8_0


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama-quantize's choice of the layers whose attn_v / ffn_down get more bits in the _M mixes."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def tensor_type(file_type: str, name: str, layer: int, num_layers: int, cols: int, tied: bool = False,
                experts: int = 0) -> str:
    """The ggml type of one weight matrix (name: "token_embd", "output", "attn_v", "ffn_down_exps", ...) in a file
    of `file_type`, as llama-quantize decides it (norms, biases and routers are always F32)."""
    if name == "ffn_gate_inp":
        return "F32"
    if file_type == "MXFP4_MOE":
        return "MXFP4" if name.endswith("_exps") else ("Q8_0" if cols % 32 == 0 else "F16")
    t = MIXES.get(file_type, file_type)
    down = name in ("ffn_down", "ffn_down_exps")
    if file_type in MIXES and (name == "output" or (tied and name == "token_embd")):
        t = "Q8_0" if cols % 256 else "Q6_K"
    elif file_type in MIXES and name == "attn_qkv":  # a fused q|k|v: one step up from the mix's type
        t = {"Q3_K_M": "Q4_K", "Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}[file_type]
    elif file_type in MIXES and name == "attn_v" and experts == 8:
        t = "Q8_0"  # llama-quantize: "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
    elif file_type in ("Q4_K_M", "Q5_K_M") and (name == "attn_v" or down) and use_more_bits(layer, num_layers):
        t = "Q6_K"
    elif file_type == "Q3_K_M" and (name in ("attn_v", "attn_output") or down):
        # Q5_K for attn_v's first two tensors and ffn_down's first sixteenth of layers (one of each per layer here)
        more = (name == "attn_v" and layer < 2) or (down and layer < num_layers // 16)
        t = "Q5_K" if more else "Q4_K"
    if t not in FLOAT_TYPES and cols % BY_NAME[t].block:
        t = FALLBACK.get(t, "F16")
        if cols % BY_NAME[t].block:
            t = "F16"
    return t


def random_kquant(rng: np.random.Generator, rows: int, cols: int, qtype: str, std: float) -> np.ndarray:
    """Well-formed random blocks of a type gguf cannot quantize to (or too slowly), as bytes [rows, row bytes]."""
    if qtype == "MXFP4":  # e8m0 scale byte, 16 bytes of e2m1 codes (uniform codes: rms 2.93 times the scale)
        nb = rows * cols // 32
        e = np.full((nb, 1), int(np.round(np.log2(std / 2.93))) + 127, np.uint8)
        return np.concatenate([e, rng.integers(0, 256, (nb, 16), dtype=np.uint8)], 1).reshape(rows, -1)
    if qtype == "IQ4_NL":  # fp16 d, 16 bytes of 4-bit indices into a table of spread ~65
        nb = rows * cols // 32
        d = np.full((nb, 1), std / 65, np.float16)
        return np.concatenate([d.view(np.uint8), rng.integers(0, 256, (nb, 16), dtype=np.uint8)], 1).reshape(rows, -1)
    nb = rows * cols // 256
    d = np.full((nb, 1), 0, np.float16)
    if qtype == "Q2_K":  # a byte per 16 (4-bit scale, 4-bit min), qs[64], fp16 d and dmin
        d[:] = np.float16(std / (8 * 1.1))  # scales ~8, codes 0..3: std 1.1
        dmin = (d.astype(np.float32) * 1.5).astype(np.float16)  # mins ~ scales: centre the codes' mean of 1.5
        parts = [rng.integers(0, 256, (nb, 80), dtype=np.uint8), d.view(np.uint8), dmin.view(np.uint8)]
        return np.concatenate(parts, 1).reshape(rows, -1)
    if qtype == "Q3_K":  # hmask[32], qs[64], 16 6-bit scales (minus 32: spread ~18) in 12 bytes, fp16 d (codes ~2.3)
        d[:] = np.float16(std / (18 * 2.3))
        return np.concatenate([rng.integers(0, 256, (nb, 108), dtype=np.uint8), d.view(np.uint8)], 1).reshape(rows, -1)
    if qtype == "IQ4_XS":  # fp16 d, 8 6-bit scales (minus 32: spread ~18) in 2 + 4 bytes, 128 bytes of indices
        d[:] = np.float16(std / (18 * 65))
        return np.concatenate([d.view(np.uint8), rng.integers(0, 256, (nb, 134), dtype=np.uint8)], 1).reshape(rows, -1)
    if qtype in ("Q4_K", "Q5_K"):
        qmax = 15 if qtype == "Q4_K" else 31
        sc = rng.integers(32, 64, (nb, 8), dtype=np.uint8)  # 6-bit sub-scales; mins = scales centre the codes
        d[:] = np.float16(std / (48 * qmax * 0.29))  # uniform codes: std qmax * 0.29
        scales = np.zeros((nb, 12), np.uint8)  # get_scale_min_k4 packing, scales == mins
        scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
        scales[:, 4:8] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
        scales[:, 8:12] = (sc[:, 4:8] & 15) | ((sc[:, 4:8] & 15) << 4)
        dmin = (d.astype(np.float32) * qmax / 2).astype(np.float16)
        parts = [d.view(np.uint8), dmin.view(np.uint8), scales]
        if qtype == "Q5_K":
            parts.append(rng.integers(0, 256, (nb, 32), dtype=np.uint8))
        parts.append(rng.integers(0, 256, (nb, 128), dtype=np.uint8))
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], fp16 d
        sc = rng.integers(16, 64, (nb, 16), dtype=np.int8) * rng.choice(np.array([-1, 1], np.int8), (nb, 16))
        d[:] = np.float16(std * 1.7 / (40 * 32))
        parts = [rng.integers(0, 256, (nb, 192), dtype=np.uint8), sc.view(np.uint8), d.view(np.uint8)]
    return np.concatenate(parts, axis=1).reshape(rows, -1)


_MXFP4_CHUNK = 1 << 20  # blocks quantized at a time (bounds the temporaries for a multi-GB expert tensor)


def quantize_mxfp4(w: np.ndarray) -> np.ndarray:
    """Float weights [..., cols] (cols a multiple of 32) as MXFP4 blocks, bytes [..., cols / 32 * 17], made as
    llama.cpp's quantize_row_mxfp4_ref makes them: per 32 weights the e8m0 scale byte e = floor(log2(amax)) + 125
    (float32 log2; 0 for a block of zeros, clamped to 0..254), then each weight's nearest value in the doubled e2m1
    table (dequant.E2M1X2) times 2^(e - 128), a tie to the smaller magnitude and zero as code 0 (ggml's first best
    index), in the nibble order of Q4_0 (element j low nibble of byte j, element j + 16 its high nibble)."""
    import torch

    from pagedllm.quantization.dequant import E2M1X2, e8m0_half

    # The code of a weight x with |x| / scale = a, by k = min(ceil(2a), top) + (top + 1 if x < 0): the doubled
    # midpoints between the magnitudes 0, 1, 2, 3, 4, 6, 8, 12 are integers (1, 3, ..., 20 = top - 1), so the
    # code's magnitude is the number of them below k (a midpoint itself rounds down); a negative weight's code is
    # 8 + its magnitude's, but 0 for zero.
    midpoints = np.add(E2M1X2[:7], E2M1X2[1:8])
    top = int(midpoints[-1]) + 1
    magnitude = np.searchsorted(midpoints, np.arange(top + 1), side="left")
    code = np.concatenate([magnitude, np.where(magnitude > 0, magnitude + 8, 0)]).astype(np.uint8)
    x = np.asarray(w, dtype=np.float32)
    if x.shape[-1] % 32:
        raise ValueError(f"MXFP4 needs rows of whole 32-element blocks, got {x.shape[-1]}")
    blocks = x.reshape(-1, 32)
    out = np.empty((blocks.shape[0], 17), np.uint8)
    for b0 in range(0, blocks.shape[0], _MXFP4_CHUNK):
        xb = blocks[b0:b0 + _MXFP4_CHUNK]
        a = np.abs(xb)
        amax = a.max(axis=1)
        with np.errstate(divide="ignore"):
            e = np.where(amax > 0, np.floor(np.log2(amax)) + 125, 0)
        e = np.clip(e, 0, 254).astype(np.uint8)  # (C's cast is undefined past uint8: amax below 2^-125)
        half_scale = e8m0_half(torch.from_numpy(e)).numpy() / 2  # exact, a subnormal at worst
        # 2|x| / d is exact (d is a power of two), and so are ggml's error comparisons near each midpoint
        np.ceil(np.divide(a, half_scale[:, None], out=a), out=a)
        k = np.minimum(a, top, out=a).astype(np.uint8)
        k += (xb < 0).view(np.uint8) * np.uint8(top + 1)
        codes = code[k]
        out[b0:b0 + _MXFP4_CHUNK, 0] = e
        out[b0:b0 + _MXFP4_CHUNK, 1:] = codes[:, :16] | codes[:, 16:] << 4
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 17)


def quantized(rng: np.random.Generator, rows: int, cols: int, qtype: str, std: float) -> np.ndarray:
    """Random weights [rows, cols] in the stored form of `qtype` (numpy array for GGUFWriter.add_tensor)."""
    import gguf

    if qtype in RANDOM_BLOCK_TYPES or (qtype == "MXFP4" and rows * cols >= RANDOM_MXFP4_MIN):
        return random_kquant(rng, rows, cols, qtype, std)
    w = (rng.standard_normal((rows, cols), dtype=np.float32) * std)
    if qtype == "F32":
        return w
    if qtype == "F16":
        return w.astype(np.float16)
    if qtype == "MXFP4":
        return quantize_mxfp4(w)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


UNUSED_TOKEN = 5  # gguf's TokenType.UNUSED


def _copy_tokenizer(writer, source: str, vocab: int) -> None:
    """The tokenizer.* metadata of `source` (the embedded SmolLM2 by default), with their GGUF value types; its
    token list padded with unused tokens up to `vocab` entries."""
    from gguf import GGUFReader, GGUFValueType

    for field in GGUFReader(source).fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = value + [f"<|unused_{i}|>" for i in range(len(value), vocab)]
        elif field.name == "tokenizer.ggml.token_type":
            value = value + [UNUSED_TOKEN] * (vocab - len(value))
        writer.add_key_value(field.name, value, vtype, sub)


@dataclass(frozen=True)
class _Planned:
    """One tensor of the file: declared in the header first, its random data made and written after."""

    name: str
    shape: tuple[int, ...]  # torch order: [experts,] rows, cols (1-D: a norm or bias)
    qtype: str
    layer: int = 0


_NUMPY_FLOATS = {"F32": np.float32, "F16": np.float16}  # written as numpy floats; every other type as bytes


def _byte_shape(p: _Planned) -> tuple[tuple[int, ...], np.dtype]:
    if p.qtype in _NUMPY_FLOATS:
        return p.shape, np.dtype(_NUMPY_FLOATS[p.qtype])
    return (*p.shape[:-1], BY_NAME[p.qtype].row_bytes(p.shape[-1])), np.dtype(np.uint8)


def _plan(s: ModelShape, file_type: str) -> list[_Planned]:
    def matrix(name: str, *shape: int, layer: int = 0) -> _Planned:
        kind = name.split(".")[-2]
        return _Planned(name, shape, tensor_type(file_type, kind, layer, s.layers, shape[-1], s.tied, s.experts),
                        layer)

    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    plan = [matrix("token_embd.weight", s.vocab, s.hidden)]
    for i in range(s.layers):
        p = f"blk.{i}."
        plan.append(_Planned(p + "attn_norm.weight", (s.hidden,), "F32"))
        attention = ((("attn_qkv", q + 2 * kv, s.hidden),) if s.fused else
                     (("attn_q", q, s.hidden), ("attn_k", kv, s.hidden), ("attn_v", kv, s.hidden)))
        for name, rows, cols in (*attention, ("attn_output", s.hidden, q)):
            plan.append(matrix(f"{p}{name}.weight", rows, cols, layer=i))
        if s.qk_norm:
            plan += [_Planned(f"{p}attn_{x}_norm.weight", (s.head_dim,), "F32") for x in "qk"]
        if s.arch in ("qwen2", "gpt-oss"):
            plan += [_Planned(f"{p}{name}.bias", (n,), "F32") for name, n in (("attn_q", q), ("attn_k", kv),
                                                                              ("attn_v", kv))]
        if s.arch == "gpt-oss":
            plan += [_Planned(f"{p}attn_output.bias", (s.hidden,), "F32"),
                     _Planned(f"{p}attn_sinks.weight", (s.heads,), "F32"),
                     _Planned(f"{p}ffn_gate_inp.bias", (s.experts,), "F32")]
            plan += [_Planned(f"{p}ffn_{x}_exps.bias", (s.experts, n), "F32")
                     for x, n in (("gate", s.expert_ffn), ("up", s.expert_ffn), ("down", s.hidden))]
        if s.experts:
            e, f = s.experts, s.expert_ffn
            plan += [matrix(f"{p}ffn_gate_inp.weight", e, s.hidden), matrix(f"{p}ffn_gate_exps.weight", e, f, s.hidden,
                     layer=i), matrix(f"{p}ffn_up_exps.weight", e, f, s.hidden, layer=i),
                     matrix(f"{p}ffn_down_exps.weight", e, s.hidden, f, layer=i)]
        elif s.fused:  # ffn_up is gate|up
            plan += [matrix(f"{p}ffn_up.weight", 2 * s.ffn, s.hidden, layer=i),
                     matrix(f"{p}ffn_down.weight", s.hidden, s.ffn, layer=i)]
        else:
            plan += [matrix(f"{p}ffn_gate.weight", s.ffn, s.hidden, layer=i),
                     matrix(f"{p}ffn_up.weight", s.ffn, s.hidden, layer=i),
                     matrix(f"{p}ffn_down.weight", s.hidden, s.ffn, layer=i)]
        norm = "post_attention_norm" if s.arch == "gpt-oss" else "ffn_norm"  # (llama.cpp's name for gpt-oss's)
        plan.append(_Planned(f"{p}{norm}.weight", (s.hidden,), "F32"))
    plan.append(_Planned("output_norm.weight", (s.hidden,), "F32"))
    if s.fused and s.context > LONGROPE_ORIGINAL:  # Phi-3's LongRoPE factors, one per rotated pair
        pairs = (s.rotary_dim or s.head_dim) // 2
        plan += [_Planned(f"rope_factors_{x}.weight", (pairs,), "F32") for x in ("short", "long")]
    if not s.tied:
        plan.append(matrix("output.weight", s.vocab, s.hidden))
    return plan


def _random_data(rng: np.random.Generator, p: _Planned, std: float) -> np.ndarray:
    if p.name.startswith("rope_factors_"):  # rising from 1 (short) or from 2 (long), as real factors do
        base = 1.0 if "short" in p.name else 2.0
        return (base + np.linspace(0.0, 1.0, p.shape[0])).astype(np.float32)
    if len(p.shape) == 1:
        base, spread = (1.0, 0.1) if p.name.endswith("norm.weight") else (0.0, std)
        return (base + spread * rng.standard_normal(p.shape[0])).astype(np.float32)
    rows = int(np.prod(p.shape[:-1]))
    data = quantized(rng, rows, p.shape[-1], p.qtype, std)
    return data.reshape(*p.shape[:-1], data.shape[-1])


def write_random_gguf(path: str, shape: ModelShape, file_type: str, seed: int = 0,
                      tokenizer_from: str | None = "default", std: float = 0.02) -> None:
    """Write a random-weight model of `shape` as `file_type` (one of FILE_TYPES). tokenizer_from: a GGUF whose
    tokenizer to copy ("default": the embedded SmolLM2; None: no tokenizer, for kernel tests). The header is
    written first and each tensor's data after it, one at a time: a file larger than the memory can be written."""
    import gguf

    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown type {file_type!r}; choose from {', '.join(FILE_TYPES)}")
    if shape.experts and shape.arch == "llama" and shape.ffn != shape.expert_ffn:
        raise ValueError("a Mixtral-style (llama) file's expert width is its feed_forward_length: ffn must equal "
                         "expert_ffn")
    rng = np.random.default_rng(seed)
    s = shape
    w = gguf.GGUFWriter(path, s.arch)
    # (not the architecture: llama.cpp gives a model named "phi3" Phi-3's special tokens, which this vocabulary lacks)
    w.add_name(f"random-{s.layers}x{s.hidden}")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.rotary_dim or s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.eps)
    w.add_vocab_size(s.vocab)
    if s.fused and s.context > LONGROPE_ORIGINAL:
        w.add_rope_scaling_orig_ctx_len(LONGROPE_ORIGINAL)
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(s.context / LONGROPE_ORIGINAL)
                                                      / np.log(LONGROPE_ORIGINAL))))
    if s.multipliers:
        for key, value in zip(("embedding_scale", "residual_scale", "attention.scale", "logit_scale"),
                              s.multipliers, strict=True):
            w.add_float32(f"{s.arch}.{key}", value)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    if s.yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.yarn[0])
        w.add_rope_scaling_orig_ctx_len(s.yarn[1])
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
        if s.arch != "llama":  # (Mixtral's expert width is its feed_forward_length)
            w.add_expert_feed_forward_length(s.expert_ffn)
    if tokenizer_from is not None:
        if tokenizer_from == "default":
            from pagedllm.model.loader import default_model_path

            tokenizer_from = default_model_path()
        _copy_tokenizer(w, tokenizer_from, s.vocab)
    plan = _plan(s, file_type)
    for p in plan:
        byte_shape, dtype = _byte_shape(p)
        raw = None if p.qtype in _NUMPY_FLOATS else gguf.GGMLQuantizationType[p.qtype]
        w.add_tensor_info(p.name, byte_shape, dtype, int(np.prod(byte_shape)) * dtype.itemsize, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for p in plan:
        w.write_tensor_data(_random_data(rng, p, std))
    w.close()


def tiny_shape(arch: str = "llama", **overrides) -> ModelShape:
    """A model small enough for unit tests, with 256-multiple widths so that every type fits."""
    base = ModelShape(arch, 2, 256, 512, 4, 2, 64, vocab=320, tied=arch == "qwen2")
    return replace(base, **overrides)
