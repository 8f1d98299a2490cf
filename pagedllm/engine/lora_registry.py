"""The engine's LoRA adapters by name and id: loads them (through the runner's LoRAManager), resolves a request's
LoRARequest to the adapter its tokens run with, and unloads them once no request uses them.

An adapter's prefix-cache key is its content (a digest of its files), not its id: two loads of the same files share
cached KV, a different adapter under a reused id or name never does, also across restarts (the disk tier)."""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.lora.adapter import LoRAAdapter, load_adapter
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.request import LoRARequest
from pagedllm.model.config import ModelConfig


@dataclass
class LoadedLoRA:
    request: LoRARequest
    key: int  # the runner's and the scheduler's id of this load (Request.lora_id)
    salt: str  # its prefix-cache key
    rank: int


@dataclass
class ReadLoRA:
    """An adapter's files read and checked, not yet added (LoRARegistry.read: any thread may do it)."""

    request: LoRARequest
    adapter: LoRAAdapter
    salt: str


def lora_cache_salt(cache_salt: str | None, lora: LoadedLoRA | None) -> str | None:
    """The request's prefix-cache salt with its adapter in it (blocks computed under another adapter, or none,
    never match)."""
    return cache_salt if lora is None else f"{cache_salt or ''}\x00lora\x00{lora.salt}"


def _digest(path: str) -> str:
    files = ([os.path.join(path, n) for n in ("adapter_config.json", "adapter_model.safetensors")]
             if os.path.isdir(path) else [path])
    h = hashlib.sha256()
    for name in files:
        with open(name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


class LoRARegistry:
    def __init__(self, manager: LoRAManager, config: ModelConfig, in_use: Callable[[int], bool]) -> None:
        """in_use(key): whether a live request runs that adapter (an unloaded adapter's weights go once not)."""
        self.manager, self.config, self.in_use = manager, config, in_use
        self.loaded: dict[str, LoadedLoRA] = {}  # by name
        self._retired: set[int] = set()  # unloaded, weights kept until their last request ends
        self._keys = itertools.count(1)

    def read(self, request: LoRARequest) -> ReadLoRA:
        """Read and check an adapter's files (InvalidModelError naming what is wrong). It reads no state that
        changes, so the server does it off the engine's thread and hands the result to resolve()."""
        mgr = self.manager
        adapter = load_adapter(request.lora_name, request.lora_path, self.config, mgr.targets, mgr.max_lora_rank)
        return ReadLoRA(request, adapter, _digest(request.lora_path))

    def resolve(self, request: LoRARequest, read: ReadLoRA | None = None) -> LoadedLoRA:
        """The adapter a request names, loaded on first use (ValueError / InvalidModelError if it cannot be).
        read: its files, already read (by read()) for this request."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self.loaded.get(request.lora_name)
        if known is not None:
            if (known.request.lora_int_id, known.request.lora_path) != (request.lora_int_id, request.lora_path):
                raise ValueError(f"LoRA adapter {request.lora_name!r} is loaded with id {known.request.lora_int_id} "
                                 f"from {known.request.lora_path!r}, not id {request.lora_int_id} from "
                                 f"{request.lora_path!r}")
            return known
        clash = next((lo for lo in self.loaded.values() if lo.request.lora_int_id == request.lora_int_id), None)
        if clash is not None:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter {clash.request.lora_name!r}")
        if read is None or read.request != request:
            read = self.read(request)
        lora = LoadedLoRA(request, next(self._keys), read.salt, read.adapter.rank)
        self.manager.add(lora.key, read.adapter)
        self.loaded[request.lora_name] = lora
        return lora

    def get(self, name: str) -> LoadedLoRA | None:
        return self.loaded.get(name)

    def remove(self, name: str) -> bool:
        """Unload by name: new requests cannot name it from now on; its weights go once its last request ends."""
        lora = self.loaded.pop(name, None)
        if lora is None:
            return False
        self._retired.add(lora.key)
        self.collect()
        return True

    def collect(self) -> None:
        """Drop the weights of unloaded adapters no live request uses any more (the engine calls it each step)."""
        for key in [k for k in self._retired if not self.in_use(k)]:
            self.manager.remove(key)
            self._retired.discard(key)

    @property
    def has_retired(self) -> bool:
        return bool(self._retired)
