"""Engine configuration: one dataclass shared by the LLM API, the CLI and the server."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass

from pagedllm.dtypes import DTYPES

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30}


def parse_bytes(value: str | int) -> int:
    """'2GiB' -> 2147483648; plain integers are bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory must look like '2GiB' or '512MiB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineArgs:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    dtype: str = "bfloat16"
    block_size: int = 16
    kv_cache_memory: str | int = "2GiB"
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_layout: str = "paged"
    attention_backend: str = "auto"
    # every kernel computes a row the same way whatever the batch: tokens do not depend on batching, chunking,
    # the prefix cache or preemption (README: what turning it off trades)
    batch_invariant: bool = False
    seed: int = 0
    structured_outputs_backend: str = "llguidance"  # or "xgrammar" (see pagedllm/structured/)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {self.dtype!r}")
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {self.kv_layout!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks!r}")
        parse_bytes(self.kv_cache_memory)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = EngineArgs()
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M)")
        g.add_argument("--dtype", default=d.dtype, choices=list(DTYPES))
        g.add_argument("--block-size", type=int, default=d.block_size)
        g.add_argument("--kv-cache-memory", default=d.kv_cache_memory)
        g.add_argument("--num-kv-blocks", type=int, default=None)
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
        g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
        g.add_argument("--kv-layout", default=d.kv_layout, choices=["paged", "contiguous"])
        g.add_argument("--attention-backend", default=d.attention_backend)
        g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=d.batch_invariant,
                       help="outputs independent of batching, chunking and the prefix cache (default: on)")
        g.add_argument("--seed", type=int, default=d.seed)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(ns, n) for n in names if hasattr(ns, n)})
