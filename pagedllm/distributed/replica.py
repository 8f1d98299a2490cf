"""One engine replica as a Ray actor: its own process, its own LLMEngine driven by an AsyncEngine.

The router calls `generate` as a streaming generator: it yields None once the engine has accepted the request
(so that a rejection, e.g. a prompt too long, surfaces before the response starts), then the request's
cumulative RequestOutputs. `abort` cancels the generator's task, whose exit aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.engine.args import EngineArgs
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class EngineReplica:
    """Wrapped with ray.remote by the client (so that importing this module needs no Ray)."""

    def __init__(self, engine_args: EngineArgs, threads: int, index: int) -> None:
        import torch

        from pagedllm.engine.async_engine import AsyncEngine

        torch.set_num_threads(threads)
        self.index = index
        self.incarnation = uuid.uuid4().hex  # new after every restart: the router then forgets its prefixes
        self.engine = AsyncEngine.from_engine_args(engine_args)
        self.engine.start()
        self._tasks: dict[str, asyncio.Task] = {}

    def info(self) -> dict[str, Any]:
        e = self.engine.engine
        return {"model_name": self.engine.model_name, "max_model_len": self.engine.max_model_len,
                "tokenizer": self.engine.tokenizer, "block_size": e.kv.block_size, "num_blocks": e.kv.num_blocks,
                **self._identity()}

    def _identity(self) -> dict[str, Any]:
        return {"index": self.index, "pid": os.getpid(), "incarnation": self.incarnation}

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       cache_salt: str | None, priority: int = 0) -> AsyncIterator[RequestOutput | None]:
        stream = await self.engine.add_request(prompt, params, request_id, cache_salt, priority=priority)
        task = asyncio.current_task()
        if task is not None:
            self._tasks[request_id] = task
        try:
            yield None
            async for out in self.engine.outputs(stream):
                yield out
        finally:
            self._tasks.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
        self.engine.abort(request_id)

    def stats(self) -> dict[str, Any]:
        """Cheap, for the router's health poll: the engine loop's newest stats and the metrics text."""
        return {"is_running": self.engine.is_running, "stats": self.engine.cached_stats(),
                "metrics": self.engine.metrics.render().decode(), **self._identity()}

    async def kv_cache_stats(self) -> dict[str, Any]:
        return await self.engine.kv_cache_stats()

    async def kv_snapshot(self) -> dict[str, Any]:
        return await self.engine.kv_snapshot()

    async def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        return await self.engine.reset_prefix_cache(reset_external)

    def shutdown(self) -> None:
        self.engine.shutdown()
