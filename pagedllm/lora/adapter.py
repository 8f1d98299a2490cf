"""Reading a LoRA adapter into the model's terms: for each of its Linear layers, per shard (q|k|v, gate|up), the pair
(A [r, in], B [rows, r]) with the adapter's scale folded into B, so that the layer adds x A^T B^T.

Two forms, mapped through the architecture's weight-name table (model/weight_names.py), as the base checkpoint is:
- a PEFT directory: adapter_config.json + adapter_model.safetensors (names as the HF model's, `lora_A`/`lora_B`);
  scale lora_alpha / r (alpha / sqrt(r) with use_rslora; per module with alpha_pattern);
- a GGUF LoRA file, as llama.cpp's convert_lora_to_gguf.py writes it (general.type "adapter", adapter.type "lora",
  `<tensor>.lora_a` / `.lora_b`, adapter.lora.alpha; scale alpha / r, 1 where alpha is 0, as llama.cpp). Its
  converter interleaved the rope pairs of q/k's B rows as it does the base weights': they are put back.

What an adapter may not do is refused at load, naming it: DoRA, trained biases, modules saved whole
(modules_to_save, embeddings, lm_head), targets the model has no LoRA layer for, a rank above max_lora_rank, a
non-finite weight.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagedllm.model import registry
from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import InvalidModelError
from pagedllm.model.linear import Linear
from pagedllm.model.weight_names import ALL, expand

# linear path ("layers.3.attn.qkv") -> {shard: (A [r, in], B [shard rows, r] scaled)}, float32
LoRAWeights = dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest of its modules' ranks
    weights: LoRAWeights


# (the module's checkpoint weight name, A, B, scale) as each form reads it
_Pair = tuple[str, torch.Tensor, torch.Tensor, float]


def load_adapter(name: str, path: str, cfg: ModelConfig, targets: dict[str, Linear], max_rank: int) -> LoRAAdapter:
    """The adapter at `path` for a model of `cfg` whose LoRA layers are `targets` (path -> Linear).
    InvalidModelError naming the file and what is wrong with it."""
    spec = registry.spec(cfg.architecture)
    if os.path.isdir(path):
        pairs, table = _read_peft(path), spec.hf_names
    elif os.path.isfile(path):
        pairs, table = _read_gguf_lora(path, cfg), spec.gguf_names
    else:
        raise InvalidModelError("no LoRA adapter here (a PEFT directory or a GGUF LoRA file)", path=path)
    names = expand(table, cfg.num_layers, cfg.num_experts)
    weights: LoRAWeights = {}
    lacking: list[str] = []
    rank = 0
    for module, a, b, scale in pairs:
        target = names.get(module)
        lin_path = target[0].rpartition(".")[0] if target and target[0].endswith(".weight") else None
        if lin_path not in targets:
            lacking.append(module.removesuffix(".weight"))
            continue
        lin, shard = targets[lin_path], target[1]
        r = a.shape[0]
        if r > max_rank:
            raise InvalidModelError(f"rank {r} of {module.removesuffix('.weight')!r} is above max_lora_rank "
                                    f"{max_rank} (raise --max-lora-rank)", path=path)
        rows = lin.output_size if shard == ALL else lin.output_sizes[shard or 0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != lin.input_size or tuple(b.shape) != (rows, r):
            raise InvalidModelError(f"{module.removesuffix('.weight')!r}: lora_A {tuple(a.shape)} / lora_B "
                                    f"{tuple(b.shape)} do not fit the layer ({rows} x {lin.input_size})", path=path)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise InvalidModelError(f"{module.removesuffix('.weight')!r} holds a non-finite weight", path=path)
        b = b.float() * scale
        pieces = enumerate(b.split(lin.output_sizes)) if shard == ALL else [(shard or 0, b)]
        for k, piece in pieces:
            order = lin.row_orders[k] if lin.row_orders else None
            weights.setdefault(lin_path, {})[k] = (a.float(), piece if order is None else piece[order])
        rank = max(rank, r)
    if lacking:
        shown = ", ".join(lacking[:4]) + (f" (+{len(lacking) - 4} more)" if len(lacking) > 4 else "")
        raise InvalidModelError(f"targets modules this model has no LoRA layer for: {shown} (LoRA applies to the "
                                f"attention and dense MLP projections)", path=path)
    if not weights:
        raise InvalidModelError("holds no LoRA weights", path=path)
    return LoRAAdapter(name, path, rank, weights)


def _read_peft(path: str) -> Iterator[_Pair]:
    from safetensors.torch import load_file

    config_path = os.path.join(path, "adapter_config.json")
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidModelError(f"cannot read adapter_config.json ({e})", path=path) from e
    if not isinstance(cfg, dict):
        raise InvalidModelError("adapter_config.json is not an object", path=path)
    refused = {"peft_type": cfg.get("peft_type", "LORA") != "LORA", "use_dora": bool(cfg.get("use_dora")),
               "bias": cfg.get("bias", "none") not in (None, "none"), "modules_to_save": bool(cfg.get("modules_to_save")),
               "fan_in_fan_out": bool(cfg.get("fan_in_fan_out"))}
    for key, bad in refused.items():
        if bad:
            raise InvalidModelError(f"{key}={cfg.get(key)!r} is not supported (plain LoRA on linear layers only)",
                                    path=path, field="adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        raise InvalidModelError("no adapter_model.safetensors (a pickled adapter_model.bin is not read: convert "
                                "it to safetensors)", path=path)
    try:
        tensors = load_file(weights_path)
    except Exception as e:  # noqa: BLE001 (safetensors raises its own types for a damaged file)
        raise InvalidModelError(f"cannot read adapter_model.safetensors ({e})", path=path) from e
    alpha, rslora = _number(cfg.get("lora_alpha", cfg.get("r", 8)), "lora_alpha", path), bool(cfg.get("use_rslora"))
    alpha_pattern = cfg.get("alpha_pattern") or {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight", key)
        if m is None:
            raise InvalidModelError(f"tensor {key!r} is not a lora_A / lora_B weight (embedding adapters, DoRA "
                                    f"magnitudes and saved modules are not supported)", path=path)
        halves.setdefault(m.group(1), {})[m.group(2)] = t
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise InvalidModelError(f"{module!r} has lora_{next(iter(ab))} but not its pair", path=path)
        r = ab["A"].shape[0]
        a_m = _number(_pattern_value(alpha_pattern, module, alpha), f"alpha_pattern[{module}]", path)
        yield f"{module}.weight", ab["A"], ab["B"], a_m / (math.sqrt(r) if rslora else r)


def _pattern_value(pattern: dict, module: str, default: object) -> object:
    """PEFT's per-module override: the first key matching the module name's tail."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _number(value: object, what: str, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidModelError(f"{what} must be a finite number, got {value!r}", path=path, field="adapter_config.json")
    return float(value)


def _read_gguf_lora(path: str, cfg: ModelConfig) -> Iterator[_Pair]:
    from pagedllm.model.gguf_loader import dequantize, unpermute
    from pagedllm.model.gguf_reader import read_gguf

    spec = registry.spec(cfg.architecture)
    f = read_gguf(path)
    try:
        meta = f.metadata
        if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
            raise InvalidModelError("is not a GGUF LoRA adapter (general.type 'adapter', adapter.type 'lora')",
                                    path=path)
        if meta.get("general.architecture") not in spec.gguf_architectures:
            raise InvalidModelError(f"is an adapter for {meta.get('general.architecture')!r} models, not for this "
                                    f"{cfg.architecture!r} model", path=path)
        if "adapter.alora.invocation_tokens" in meta:
            raise InvalidModelError("is an activated LoRA (aLoRA), which is not supported", path=path)
        alpha = _number(meta.get("adapter.lora.alpha", 0.0), "adapter.lora.alpha", path)
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, info in f.tensors.items():
            base, dot, half = name.rpartition(".")
            if not dot or half not in ("lora_a", "lora_b"):
                raise InvalidModelError(f"tensor {name!r} is not a lora_a / lora_b weight", path=path)
            halves.setdefault(base, {})[half] = dequantize(f, info).float()
    finally:
        f.close()
    for module, ab in halves.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise InvalidModelError(f"{module!r} lacks its lora_a / lora_b pair", path=path)
        a, b = ab["lora_a"], ab["lora_b"]
        if spec.gguf_permuted_qk and module.endswith((".attn_q.weight", ".attn_k.weight")):
            b = unpermute(b, cfg.num_heads if module.endswith(".attn_q.weight") else cfg.num_kv_heads)
        r = a.shape[0]
        yield module, a, b, alpha / r if alpha else 1.0
