"""LoRARequest: which adapter a request runs with, named as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: what the server lists and requests address it by; lora_int_id: its identity (>= 1, unique per
    adapter: a request naming an id already loaded reuses that adapter); lora_path: a PEFT directory
    (adapter_config.json + adapter_model.safetensors) or a GGUF LoRA file (llama.cpp's convert_lora_to_gguf.py)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty path")


class LoRANotFoundError(LookupError):
    """A request names an adapter the engine does not hold (the server's: unloaded while the request was on its
    way; a server never loads an adapter on first use, only through its load endpoint or --lora-modules)."""

    def __init__(self, lora_name: str) -> None:
        super().__init__(lora_name)
        self.lora_name = lora_name
