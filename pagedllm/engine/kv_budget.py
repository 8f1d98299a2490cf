"""The KV pool's bytes: kv_cache_memory on the CPU; on a GPU what a profiled largest step leaves of
gpu_memory_utilization (as vLLM sizes it), less a draft model's weights and its pool's share.

A draft model on a GPU is loaded before the pools are sized (draft_loaded_first): its weights come out of the
budget, and its pool (as many blocks as the target's) takes its share of the rest by bytes per block.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.core.kv_groups import KVGroupLayout
from pagedllm.engine.args import EngineArgs, EngineConfigError, parse_bytes
from pagedllm.engine.placement import Placement
from pagedllm.model.config import ModelConfig
from pagedllm.model.kv_cache import kv_bytes_per_block
from pagedllm.model.loader import LoadedModel, load_model
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def draft_loaded_first(placement: Placement, spec: dict | None, dtype: torch.dtype) -> LoadedModel | None:
    """On a GPU, a draft model (speculative_config method "draft_model") loaded now, before the pools are sized;
    None elsewhere (the speculator loads it)."""
    spec = spec or {}
    if placement.device.type == "cpu" or spec.get("method") != "draft_model":
        return None
    return load_model(spec["model"], dtype, quantization=placement.quantization, load_tokenizer=False)


def kv_budget(args: EngineArgs, placement: Placement, model: torch.nn.Module, config: ModelConfig,
              kv_dtype: torch.dtype, layout: KVGroupLayout, draft: LoadedModel | None) -> int:
    """Bytes for the target's KV pool."""
    device = placement.device
    if device.type == "cpu":
        return parse_bytes(args.kv_cache_memory)

    def profile() -> None:  # the largest step over a throwaway pool just big enough for it
        tokens = args.max_num_batched_tokens
        runner = ModelRunner(model, config, num_blocks=-(-tokens // args.block_size) + 1, block_size=args.block_size,
                             kv_dtype=kv_dtype, attention_backend=placement.backend, device=device, layout=layout)
        runner.profile_step(tokens, min(args.max_num_seqs, tokens))

    budget = gpu_kv_budget(device, args.gpu_memory_utilization, profile)
    if draft is None:
        return budget
    weights = sum(p.numel() * p.element_size() for p in draft.model.parameters())
    ours = kv_bytes_per_block(config, args.block_size, kv_dtype, layout.group_size)
    theirs = kv_bytes_per_block(draft.config, args.block_size, draft.dtype)
    return (budget - weights) * ours // (ours + theirs)


def gpu_kv_budget(device: torch.device, utilization: float, profile_step) -> int:
    """Bytes the KV pool may take on a GPU: total x utilization, less the memory in use at the peak of
    `profile_step()` (the weights plus the largest step's activations, run once over a small pool) and what other
    processes hold."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    others = max(0, total - free - torch.cuda.memory_reserved(device))
    budget = int(total * utilization) - peak - others
    logger.info("GPU memory: %.1f GiB total, x %.2f = %.1f GiB; weights + activation peak %.1f GiB, other processes "
                "%.1f GiB: %.1f GiB for the KV cache", total / 2**30, utilization, total * utilization / 2**30,
                peak / 2**30, others / 2**30, budget / 2**30)
    if budget <= 0:
        raise EngineConfigError(
            f"no GPU memory is left for the KV cache: {total / 2**30:.1f} GiB x gpu_memory_utilization "
            f"{utilization} is less than the weights and activations ({peak / 2**30:.1f} GiB) plus other processes "
            f"({others / 2**30:.1f} GiB); raise gpu_memory_utilization or use a smaller model")
    return budget
