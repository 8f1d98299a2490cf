"""Write a random-weight GGUF of a real model shape: `pagedllm bench make-model --shape tinyllama-1.1b --type Q4_0
OUT.gguf` (the embedded SmolLM2 tokenizer; shapes and types in pagedllm.testing.gguf_writer)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from pagedllm.testing.gguf_writer import FILE_TYPES, SHAPES, write_random_gguf


def cached_model(shape: str, file_type: str, layers: int | None = None) -> str:
    """The benchmark file for (shape, type[, layers]) under the cache directory, written on first use."""
    from pagedllm.paths import cache_dir

    vocab = SHAPES[shape].vocab if shape in SHAPES else 0  # in the name: a shape's vocabulary has changed before
    depth = f"-l{layers}" if layers else ""
    path = os.path.join(cache_dir(), "bench-models", f"random-{shape}{depth}-v{vocab}.{file_type}.gguf")
    if not os.path.isfile(path):
        write(shape, file_type, path, layers=layers)
    return path


def write(shape: str, file_type: str, path: str, seed: int = 0, context: int | None = None,
          layers: int | None = None) -> None:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    t0 = time.perf_counter()
    changes = {k: v for k, v in (("context", context), ("layers", layers)) if v}
    spec = dataclasses.replace(SHAPES[shape], **changes)
    write_random_gguf(tmp, spec, file_type, seed=seed)
    os.replace(tmp, path)  # never leave a half-written model under the final name
    print(f"wrote {path} ({os.path.getsize(path) / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--type", required=True, choices=FILE_TYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=None, help="context length in the file (default: the shape's)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers of the same widths (default: the shape's)")


def run(args: argparse.Namespace) -> None:
    write(args.shape, args.type, args.out, args.seed, args.context, args.layers)
