"""Where the model runs: the device, its attention backend, how the weights load for it, and (on a GPU) how
many KV blocks fit.

On the CPU the C++ kernels run everything (GGUF blocks as stored). On a GPU the weights are dense bf16 (a GGUF
file is dequantized once at load; there are no quantized GPU kernels), the attention is a device backend (Triton
or FlexAttention), and the block pool is sized as vLLM sizes it: the GPU's memory times gpu_memory_utilization,
less what the weights, a profiled forward of the largest step and other processes take. The same torch path runs
on the CPU when a device backend is named (`attention_backend="triton"|"flex"`): that is how the tests cover it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedllm.attention import AttentionBackend, get_backend
from pagedllm.engine.args import EngineArgs, EngineConfigError

logger = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda", "auto")


def resolve_device(name: str) -> torch.device:
    """"cpu", "cuda" (or "cuda:N") or "auto" (a GPU where torch sees one)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type not in ("cpu", "cuda"):
        raise EngineConfigError(f"device must be one of {', '.join(map(repr, DEVICES))}, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineConfigError(f"device {name!r}: torch sees no CUDA GPU here (torch {torch.__version__}); "
                                f"use device='cpu'")
    return device


@dataclass
class Placement:
    device: torch.device
    backend: AttentionBackend
    quantization: str  # what the loader is asked for
    dtype: str

    @property
    def torch_path(self) -> bool:
        """Every layer in torch ops (no C++ kernel): a GPU, or a device backend on the CPU."""
        return self.device.type != "cpu" or not getattr(self.backend, "cpu_kernels", False)


def place(args: EngineArgs) -> Placement:
    """The device and backend for `args`, and what the loader must do for them; a combination that cannot run
    there is a ValueError naming it, before anything loads."""
    device = resolve_device(args.device)
    backend = get_backend(args.attention_backend, device)
    placement = Placement(device, backend, args.quantization, args.dtype)
    if not placement.torch_path:
        if args.dtype == "float16":
            raise EngineConfigError("dtype='float16' runs on a GPU (device='cuda'); the CPU's kernels compute in "
                                    "bfloat16 or float32")
        return placement
    if args.quantization in ("gguf", "int8"):
        raise EngineConfigError(f"quantization={args.quantization!r} runs on the C++ CPU kernels; on {device.type} with "
                                f"the {backend.name!r} attention backend weights are dequantized (quantization "
                                f"'none' or 'auto')")
    placement.quantization = "none"
    if device.type == "cuda" and args.dtype == "auto":
        placement.dtype = "bfloat16"
    if device.type != "cpu":
        for flag, on in (("enable_lora", args.enable_lora), ("kv_disk_cache_dir", args.kv_disk_cache_dir)):
            if on:
                raise EngineConfigError(f"{flag} runs on the CPU only so far; not with device={args.device!r}")
    return placement


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
