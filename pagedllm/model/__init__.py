"""Decoder models over the paged KV cache (architectures in registry.py), and their loaders."""

from pagedllm.model.config import ModelConfig, UnsupportedModelError, check_token_ids
from pagedllm.model.kv_cache import allocate_kv_caches, kv_bytes_per_block, num_blocks_for_budget
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import LoadedModel, default_model_path, load_model

__all__ = ["LlamaForCausalLM", "LoadedModel", "ModelConfig", "UnsupportedModelError", "allocate_kv_caches",
           "check_token_ids", "default_model_path", "kv_bytes_per_block", "load_model", "num_blocks_for_budget"]
