"""Load named checkpoint tensors into a model through a weight-name table (weight_names.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.model.linear import Linear, load_dense
from pagedllm.model.weight_names import ALL, IGNORED_SUFFIXES, TIED_COPIES, Target, expand
from pagedllm.quantization.tensor import QuantTensor


def _owner(model: nn.Module, path: str) -> tuple[nn.Module | None, str]:
    module_path, _, leaf = path.rpartition(".")
    try:
        return (model.get_submodule(module_path) if module_path else model), leaf
    except AttributeError:
        return None, leaf


def _has_target(model: nn.Module, path: str) -> bool:
    owner, leaf = _owner(model, path)
    if isinstance(owner, Linear):
        return owner.has(leaf)
    return isinstance(getattr(owner, leaf, None), nn.Parameter)


def _load_one(model: nn.Module, path: str, shard: int | None, tensor: torch.Tensor | QuantTensor, name: str) -> None:
    owner, leaf = _owner(model, path)
    if isinstance(owner, Linear):
        owner.load_weight(leaf, tensor, shard, name)
    elif isinstance(tensor, QuantTensor):  # an embedding table kept in its stored blocks (also a tied head)
        tensor.packed().replace_parameter(owner, leaf, name)
    else:
        load_dense(getattr(owner, leaf), tensor, name)


def _experts_of(stacked: torch.Tensor | list[QuantTensor], num_experts: int, name: str):
    """The per-expert pieces of a stacked expert tensor (a dense tensor, matrices or biases, or the loader's list
    of per-expert QuantTensors), after checking there is one per expert."""
    count = len(stacked) if isinstance(stacked, list) else (stacked.shape[0] if stacked.dim() >= 2 else -1)
    if count != num_experts:
        shape = [len(stacked), *stacked[0].shape] if isinstance(stacked, list) else list(stacked.shape)
        raise ValueError(f"weight {name!r}: shape {tuple(shape)} does not stack {num_experts} experts "
                         f"(the config's expert count)")
    return stacked if isinstance(stacked, list) else stacked.unbind(0)


def _shards_of(model: nn.Module, path: str, tensor: torch.Tensor | QuantTensor, name: str):
    """A fused checkpoint tensor (every shard of a Linear, stacked by rows) as (shard, piece) pairs."""
    owner, _ = _owner(model, path)
    sizes = owner.output_sizes
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not stack the config's shards "
                         f"({' + '.join(map(str, sizes))} rows)")
    if isinstance(tensor, QuantTensor):
        return enumerate(tensor.split_rows(sizes))
    return enumerate(tensor.split(sizes))


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], table: dict[str, Target],
                 num_layers: int, num_experts: int = 0) -> None:
    """Put every checkpoint tensor where `table` says. Raises ValueError on a name the table does not know or the
    model has no place for, on a shape that does not fit, and on weights the model needs that never came."""
    names = expand(table, num_layers, num_experts)
    expected = {name for name, (path, _) in names.items() if _has_target(model, path.replace("{e}", "0"))}
    seen: set[str] = set()
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES) or (name in TIED_COPIES and name not in expected):
            continue  # recomputed, folded into the config, or the copy a tied checkpoint stores anyway
        if name not in expected:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        path, shard = names[name]
        if "{e}" in path:  # every expert's tensor of a layer, stacked (GGUF)
            for e, piece in enumerate(_experts_of(tensor, num_experts, name)):
                _load_one(model, path.replace("{e}", str(e)), shard, piece, f"{name}[{e}]")
        elif shard == ALL:
            for k, piece in _shards_of(model, path, tensor, name):
                _load_one(model, path, k, piece, f"{name}[{k}]")
        else:
            _load_one(model, path, shard, tensor, name)
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[:3]}")
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.process_weights_after_loading(module)
