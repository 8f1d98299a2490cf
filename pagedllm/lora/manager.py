"""The runner's LoRA state: the adapters held in memory, and which of them sit in the model's `max_loras` slots.

The scheduler keeps at most max_loras distinct adapters among the running requests (SchedulerConfig.max_loras),
so a step's adapters always fit the slots: one not in a slot takes a slot no adapter of this step uses (the least
recently used first), and its weights are copied into every layer's stack.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

from torch import nn

from pagedllm.lora.adapter import LoRAAdapter
from pagedllm.lora.layers import LoRAStack, lora_batch, make_batch
from pagedllm.model.linear import Linear


def lora_targets(model: nn.Module) -> dict[str, Linear]:
    """The Linears an adapter may target: attention and dense MLP projections (not experts, routers or the head)."""
    return {path: m for path, m in model.named_modules() if isinstance(m, Linear) and path.startswith("layers.")
            and ".experts." not in path and not path.endswith(".router")}


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_lora_rank}")
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.targets = lora_targets(model)
        for lin in self.targets.values():
            lin.lora = LoRAStack(lin.input_size, lin.output_sizes, max_loras, max_lora_rank)
        # the fused C++ layer reads the base weights only: with LoRA on, every batch runs the torch layers, so
        # a base-model row computes the same way whether or not adapter rows share its batch
        model.fused_layers = False
        self.adapters: dict[int, LoRAAdapter] = {}
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first

    def add(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        self.adapters[adapter_id] = adapter

    def remove(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)
        slot = self._slots.pop(adapter_id, None)
        if slot is not None:
            for lin in self.targets.values():
                lin.lora.set_slot(slot, None)

    @contextlib.contextmanager
    def batch(self, row_adapters: list[int | None]) -> Iterator[None]:
        """A forward whose row i runs adapter row_adapters[i] (None: the base model)."""
        wanted = {a for a in row_adapters if a is not None}
        if not wanted:
            with lora_batch(None):
                yield
            return
        for a in wanted:
            self._place(a, wanted)
        slot = {a: self._slots[a] for a in wanted}
        with lora_batch(make_batch([-1 if a is None else slot[a] for a in row_adapters])):
            yield

    def _place(self, adapter_id: int, wanted: set[int]) -> None:
        if adapter_id in self._slots:
            self._slots.move_to_end(adapter_id)
            return
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters exceeds max_loras {self.max_loras}")
        used = set(self._slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if not free:
            victim = next(a for a in self._slots if a not in wanted)
            free = [self._slots.pop(victim)]
        adapter = self.adapters[adapter_id]
        for path, lin in self.targets.items():
            lin.lora.set_slot(free[0], adapter.weights.get(path))
        self._slots[adapter_id] = free[0]
