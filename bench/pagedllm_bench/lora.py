"""LoRA: a batch that mixes adapters and the base model against the same batch on the base model alone.

`pagedllm bench lora [--quick] [--adapters 4] [--rank 16] [--requests 64] [--repeats N]`. Random PEFT adapters of
rank --rank on every attention and MLP projection of the model (written as PEFT directories, as a fine-tune would
leave them), the offline workload's shape (prompts U[32,256], outputs U[64,128], ignore_eos) with request i run on
adapter i mod (adapters + 1) (the last share: the base model). Three runs on one engine (LoRA on, max_loras =
adapters), alternating, medians over --repeats (the ratios: the median of each round's own ratio): every request on the base model, the mixed batch, and the mixed batch
with every request on one adapter. Also the same batch on an engine without LoRA (what enabling it costs a base-only
workload). Target (issue 57): mixed >= 0.8x base alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from pagedllm_bench import common

TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p, "16 requests, short outputs")
    p.add_argument("--adapters", type=int, default=4, help="distinct adapters in the mixed batch")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=None, help="requests per run (default 64; --quick 16)")
    p.set_defaults(quantization="auto", dtype="auto")  # the engine's defaults (GGUF weights as stored)


def write_random_adapter(path: str, cfg, rank: int, seed: int) -> str:
    """A PEFT LoRA directory for a model of `cfg` (pagedllm's ModelConfig), random A and B of small norm."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (cfg.hidden_size, cfg.q_size), "self_attn.k_proj": (cfg.hidden_size, cfg.kv_size),
              "self_attn.v_proj": (cfg.hidden_size, cfg.kv_size), "self_attn.o_proj": (cfg.q_size, cfg.hidden_size),
              "mlp.gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "mlp.up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "mlp.down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    tensors = {}
    for i in range(cfg.num_layers):
        for module in TARGETS:
            fan_in, fan_out = shapes[module]
            key = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [m.split(".")[-1] for m in TARGETS]}, f)
    return path


def _run(llm, prompts, params, loras) -> tuple[float, int]:
    llm.engine.reset_prefix_cache()  # every run cold: the runs repeat the same prompts, under other adapters
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def measure(args: argparse.Namespace) -> dict:
    from pagedllm import LLM, LoRARequest, SamplingParams

    common.set_threads(args.threads)
    n = args.requests or (16 if args.quick else 64)
    rng = np.random.default_rng(args.seed)
    ids = common.normal_token_ids(args.model)
    prompts = [{"prompt_token_ids": p} for p in common.random_prompts(rng, ids, rng.integers(32, 257, size=n))]
    olens = rng.integers(16, 33, size=n) if args.quick else rng.integers(64, 129, size=n)
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in olens]
    lora_llm = LLM(**common.llm_kwargs(args, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                                       max_step_ms="off"))
    plain_llm = LLM(**common.llm_kwargs(args, max_step_ms="off"))
    cfg = lora_llm.engine.model_config
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{k}", k + 1, write_random_adapter(os.path.join(tmp, f"a{k}"), cfg, args.rank, k))
                    for k in range(args.adapters)]
        for a in adapters:
            lora_llm.engine.add_lora(a)
        runs = {"base alone (LoRA on)": (lora_llm, [None] * n),
                "mixed": (lora_llm, [(adapters + [None])[i % (len(adapters) + 1)] for i in range(n)]),
                "one adapter": (lora_llm, [adapters[0]] * n),
                "base alone (LoRA off)": (plain_llm, [None] * n)}
        for llm, loras in runs.values():  # warm: the first batch of each pays first-use costs
            _run(llm, prompts[:2], params[:2], loras[:2])
        times: dict[str, list[float]] = {name: [] for name in runs}
        tokens = {}
        for rep in range(max(1, args.repeats)):
            for name in (list(runs) if rep % 2 == 0 else list(reversed(runs))):
                llm, loras = runs[name]
                t, tokens[name] = _run(llm, prompts, params, loras)
                times[name].append(t)
                print(f"{name}: {tokens[name] / t:.1f} tok/s", file=sys.stderr, flush=True)
    base = "base alone (LoRA on)"
    # this VM's speed drifts by tens of % between minutes: each round's own ratio to its base run, then the median
    rows = [{"batch": name, "requests": n, "output_tokens": tokens[name],
             "tok_s": tokens[name] / statistics.median(times[name]),
             "vs_base_alone": statistics.median(tb / t for t, tb in zip(times[name], times[base], strict=True))}
            for name in runs]
    print(common.table(rows, title=f"LoRA: {args.adapters} adapters of rank {args.rank} + base, {n} requests "
                                   f"(request i on adapter i mod {args.adapters + 1}), greedy"))
    payload = {"bench": "lora", "env": common.environment(args.threads), "adapters": args.adapters,
               "rank": args.rank, "results": rows}
    jp, _ = common.save("lora" + args.tag, payload, None, args.out_dir)
    print(f"wrote {jp}")
    return payload


run = measure  # what `pagedllm bench` calls
