"""LoRA adapters: loaded from PEFT directories or llama.cpp's GGUF LoRA files, many per engine, applied per request
and batched across adapters (each adapter's low-rank product on its own rows, the base GEMM once for all)."""

from pagedllm.lora.request import LoRANotFoundError, LoRARequest

__all__ = ["LoRANotFoundError", "LoRARequest"]
