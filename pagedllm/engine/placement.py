"""Where the model runs: the device, its attention backend, and how the weights load for it (engine/kv_budget.py:
how many KV blocks fit there).

On the CPU the C++ kernels run everything (GGUF blocks as stored). On a GPU the weights are dense bf16 (a GGUF
file is dequantized once at load; there are no quantized GPU kernels), the attention is a device backend (Triton
or FlexAttention), and the block pool is sized as vLLM sizes it: the GPU's memory times gpu_memory_utilization,
less what the weights, a profiled forward of the largest step and other processes take. The same torch path runs
on the CPU when a device backend is named (`attention_backend="triton"|"flex"`): that is how the tests cover it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention import AttentionBackend, get_backend
from pagedllm.engine.args import EngineArgs, EngineConfigError

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
