"""Structured outputs: the grammar backends side by side, and what constraining costs a decode step.

Backends (each installed one, on the model's own tokenizer): building the backend, compiling a mid-sized JSON
schema cold and from the cache, the per-step mask fill for 32 matchers walking a valid instance, and which JSON
Schema features compile. Engine: 64 running requests, half constrained by that schema, decode step time
against 64 unconstrained requests in the same process (runs alternated).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pagedllm.structured import GrammarError, StructuredOutputsParams
from pagedllm.structured.backend import BACKENDS, bitmask_words, make_backend
from pagedllm_bench import common

_STR = {"type": "string", "maxLength": 24}
ORDER_SCHEMA = {  # mid-sized: nested objects, an array of objects, enums, patterns, numeric ranges
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {"type": "object", "properties": {
            "name": _STR, "email": {"type": "string", "format": "email"},
            "address": {"type": "object", "properties": {"street": _STR, "city": _STR,
                                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                          "country": {"enum": ["FR", "DE", "IT", "ES", "UK"]}},
                        "required": ["street", "city", "zip", "country"], "additionalProperties": False}},
            "required": ["name", "email", "address"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "quantity", "price"],
            "additionalProperties": False}},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "priority": {"type": "boolean"},
        "notes": {"anyOf": [_STR, {"type": "null"}]},
    },
    "required": ["order_id", "customer", "items", "status", "priority", "notes"],
    "additionalProperties": False,
}
ORDER = {"order_id": "ORD-123456", "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "address": {
    "street": "12 Rue de Rivoli", "city": "Paris", "zip": "75001", "country": "FR"}},
    "items": [{"sku": "ABC-123", "quantity": 2, "price": 19.99}, {"sku": "XYZ-999", "quantity": 1, "price": 5}],
    "status": "paid", "priority": False, "notes": None}
FEATURES = {  # JSON Schema coverage probes: does the backend compile each?
    "$ref/$defs": {"$defs": {"p": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                       "$ref": "#/$defs/n"},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "const": {"const": "fixed"},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
    "format: date-time": {"type": "string", "format": "date-time"},
    "format: uuid": {"type": "string", "format": "uuid"},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x-": {"type": "string"}}},
    "minProperties": {"type": "object", "minProperties": 1},
    "if/then/else": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
    "not": {"not": {"type": "string"}},
}


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p, "backends on a smaller walk, 16 running requests, 8 steps")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run (all requests running)")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_backend(name: str, tokenizer, vocab: int, eos: list[int], walk_rows: int) -> dict:
    t0 = time.perf_counter()
    backend = make_backend(name, tokenizer, vocab, eos)
    build = time.perf_counter() - t0
    params = StructuredOutputsParams(json=ORDER_SCHEMA)
    t0 = time.perf_counter()
    compiled = backend.compile(params)
    cold = time.perf_counter() - t0
    matchers = [backend.matcher(compiled) for _ in range(walk_rows)]
    bitmask = np.zeros((walk_rows, bitmask_words(vocab)), np.int32)
    rows = list(range(walk_rows))
    ids = tokenizer.encode(json.dumps(ORDER, separators=(",", ":")), add_special_tokens=False)
    fills = []
    for t in ids:
        fills.append(_timed(lambda: backend.fill_bitmasks(matchers, bitmask, rows)))
        assert all(m.accept(t) for m in matchers), f"{name} rejected a valid instance at {tokenizer.decode([t])!r}"
    covered = []
    for feature, schema in FEATURES.items():
        try:
            backend.compile(StructuredOutputsParams(json=schema))
            covered.append(feature)
        except GrammarError:
            pass
    return {"backend": name, "build s": build, "compile cold ms": cold * 1e3,
            "first mask ms": fills[0] * 1e3, "mask ms (median)": common.median(fills[1:]) * 1e3,
            "mask ms (p99)": common.pct(fills[1:], 99) * 1e3, "rows": walk_rows, "steps": len(ids),
            "features": f"{len(covered)}/{len(FEATURES)}", "missing": [f for f in FEATURES if f not in covered]}


def decode_step_ms(llm, prompts: list[str], constrained: bool, steps: int) -> tuple[float, int]:
    """Median decode step (ms) with every request running; half the requests constrained when asked."""
    from pagedllm import SamplingParams

    eng = llm.engine
    free = SamplingParams(temperature=0.7, max_tokens=steps + 64, ignore_eos=True)
    json_params = SamplingParams(temperature=0.7, max_tokens=steps + 64,
                                 structured_outputs=StructuredOutputsParams(json=ORDER_SCHEMA))
    ids = [f"s{constrained}-{i}-{time.perf_counter_ns()}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(ids, prompts, strict=True)):
        eng.add_request(rid, p, json_params if constrained and i % 2 == 0 else free)
    while len(eng.scheduler.running) < len(prompts) or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        eng.step()
    times = []
    for _ in range(steps):
        times.append(_timed(eng.step))
    running = len(eng.scheduler.running)
    eng.abort_request(ids)
    return common.median(times) * 1e3, running


def run(args: argparse.Namespace) -> dict:
    from pagedllm import LLM

    common.set_threads(args.threads)
    if args.quick:
        args.num_requests, args.steps = 16, 8
    llm = LLM(**common.llm_kwargs(args, max_num_seqs=max(args.num_requests, 1)))
    eng = llm.engine
    tok, vocab, eos = eng.tokenizer, eng.model_config.vocab_size, sorted(eng.eos_token_ids)
    backends = [bench_backend(b, tok, vocab, eos, 8 if args.quick else 32) for b in args.backends.split(",")]
    print(common.table([{k: v for k, v in r.items() if k != "missing"} for r in backends],
                       title="Backends: a mid-sized JSON schema (ORDER_SCHEMA) on the model's tokenizer"))
    for r in backends:
        print(f"  {r['backend']} does not compile: {', '.join(r['missing']) or '-'}")

    mgr = eng.structured_outputs  # the engine's own manager (default backend): cold, then cached
    _ = mgr.backend  # built once per engine (walks the vocabulary): not part of a compile
    params = StructuredOutputsParams(json=dict(ORDER_SCHEMA, title="cold"))
    cold = _timed(lambda: mgr.compile(params))
    cached = _timed(lambda: mgr.compile(StructuredOutputsParams(json=dict(ORDER_SCHEMA, title="cold"))))
    print(f"\nengine manager ({mgr.backend_name}): compile cold {cold * 1e3:.1f} ms, cached {cached * 1e6:.0f} us")

    common.warm_up(llm)
    prompts = [f"Write order number {i} of a web shop as JSON." for i in range(args.num_requests)]
    runs = []
    for rep in range(max(args.repeats, 2)):  # alternate: the VM's speed drifts between minutes
        for constrained in ((False, True) if rep % 2 == 0 else (True, False)):
            ms, running = decode_step_ms(llm, prompts, constrained, args.steps)
            runs.append({"run": rep, "constrained": "half" if constrained else "none", "step ms": ms,
                         "running": running})
    free_ms = common.median([r["step ms"] for r in runs if r["constrained"] == "none"])
    half_ms = common.median([r["step ms"] for r in runs if r["constrained"] == "half"])
    print(common.table(runs, title=f"Decode step, {args.num_requests} running (half constrained or none)"))
    print(f"half constrained / unconstrained: {half_ms / free_ms:.3f}x (target <= 1.10x)")
    payload = {"environment": common.environment(args.threads), "args": vars(args), "backends": backends,
               "compile_cold_ms": cold * 1e3, "compile_cached_us": cached * 1e6, "runs": runs,
               "step_ratio": half_ms / free_ms}
    common.save("structured" + args.tag, payload, out_dir=args.out_dir)
    return payload
