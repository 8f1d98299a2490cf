"""DataParallelEngine: N EngineReplica actors behind the interface the OpenAI handlers use (AsyncEngine's:
add_request / outputs / abort, tokenizer, model facts, metrics, start / shutdown), so that streaming, n,
errors, auth, disconnects and graceful shutdown work as in the single-process server.

The router keeps, per replica, the requests it sent there (its load, known at once) and polls every replica's
stats (health, KV usage, metrics) in the background. A replica whose process dies fails only its in-flight
requests (ReplicaDiedError, a 503) and is skipped at once; Ray restarts it (max_restarts) and the next
successful poll takes it back, with its prefix table cleared (new incarnation, empty cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from pagedllm.distributed.args import DataParallelArgs
from pagedllm.distributed.metrics import merge_replica_metrics
from pagedllm.distributed.replica import EngineReplica
from pagedllm.distributed.routing import NoHealthyReplicaError, ReplicaLoad, make_policy
from pagedllm.engine.args import EngineArgs
from pagedllm.engine.async_engine import EngineDeadError, RequestFailedError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.templating.sandbox import render_chat_template

logger = logging.getLogger(__name__)


class ReplicaDiedError(EngineDeadError):
    """The replica serving this request died (its process exited or became unreachable)."""


@dataclass
class _Replica:
    index: int
    actor: Any
    healthy: bool = False
    incarnation: str | None = None
    pid: int | None = None
    restarts: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)  # request id -> estimated tokens
    stats: dict = field(default_factory=dict)
    metrics_text: str = ""
    last_error: str | None = None

    def load(self) -> ReplicaLoad:
        num_blocks = self.stats.get("num_blocks") or 0
        usage = (num_blocks - self.stats.get("num_free_blocks", num_blocks)) / num_blocks if num_blocks else 0.0
        return ReplicaLoad(self.healthy, len(self.in_flight), sum(self.in_flight.values()), usage)

    def mark_down(self, error: BaseException | str) -> None:
        if self.healthy:
            logger.warning("replica %d is down: %s", self.index, error)
        self.healthy = False
        self.last_error = str(error)


@dataclass
class ReplicaStream:
    """One request on one replica: the Ray streaming generator of its outputs."""

    request_id: str
    replica: int
    gen: Any
    finished: bool = False


class _Metrics:
    def __init__(self, engine: DataParallelEngine) -> None:
        self.engine = engine

    def render(self) -> bytes:
        """From the newest poll of each replica (at most health_interval old)."""
        reps = self.engine.replicas
        return merge_replica_metrics({r.index: r.metrics_text for r in reps}, {r.index: r.healthy for r in reps})


class DataParallelEngine:
    def __init__(self, engine_args: EngineArgs, dp: DataParallelArgs) -> None:
        self.dp = dp
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            if dp.ray_address is not None:
                ray.init(address=dp.ray_address)
            else:
                ray.init(num_cpus=dp.data_parallel_size * dp.threads_per_replica,
                         object_store_memory=dp.object_store_memory, include_dashboard=False)
        threads = dp.threads_per_replica
        actor_cls = ray.remote(EngineReplica).options(
            num_cpus=threads, max_restarts=dp.max_restarts, max_task_retries=0,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})
        self.replicas = [_Replica(i, actor_cls.remote(engine_args, threads, i))
                         for i in range(dp.data_parallel_size)]
        try:
            infos = ray.get([r.actor.info.remote() for r in self.replicas], timeout=dp.startup_timeout)
        except BaseException:
            self._kill_all()
            raise
        for r, info in zip(self.replicas, infos, strict=True):
            r.healthy, r.incarnation, r.pid = True, info["incarnation"], info["pid"]
        first = infos[0]
        self.tokenizer = first["tokenizer"]
        self.model_name: str = first["model_name"]
        self.max_model_len: int = first["max_model_len"]
        self.block_size: int = first["block_size"]
        self.policy = make_policy(dp.routing_policy, len(self.replicas), self.block_size,
                                  **({"table_blocks": first["num_blocks"]} if dp.routing_policy == "prefix" else {}))
        self.metrics = _Metrics(self)
        self._monitor: asyncio.Task | None = None
        self._closed = False
        logger.info("%d engine replicas up (%d threads each), routing: %s", len(self.replicas), threads,
                    self.policy.name)

    # -- model facts ------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> str:
        return render_chat_template(self.tokenizer, messages, **kwargs)

    # -- life cycle -------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return not self._closed and any(r.healthy for r in self.replicas)

    def start(self) -> None:
        """Start the health poll (call from the event loop that serves the requests)."""
        if self._monitor is None and not self._closed:
            self._monitor = asyncio.get_running_loop().create_task(self._poll_forever())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the replicas (in-flight requests end with an error) and the Ray we started."""
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            self._monitor.cancel()
        with contextlib.suppress(Exception):
            ray.get([r.actor.shutdown.remote() for r in self.replicas if r.healthy], timeout=timeout)
        self._kill_all()
        if self._owns_ray:
            ray.shutdown()

    def _kill_all(self) -> None:
        for r in self.replicas:
            with contextlib.suppress(Exception):
                ray.kill(r.actor, no_restart=True)

    def health_report(self) -> list[dict[str, Any]]:
        return [{"replica": r.index, "healthy": r.healthy, "pid": r.pid, "restarts": r.restarts,
                 "num_requests": len(r.in_flight), "num_running": r.stats.get("num_running"),
                 "num_waiting": r.stats.get("num_waiting"), "kv_cache_usage": round(r.load().kv_usage, 4),
                 "last_error": None if r.healthy else r.last_error} for r in self.replicas]

    async def _poll_forever(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self._poll(r) for r in self.replicas))
            except Exception:  # never let the health poll die: the router depends on it to take replicas back
                logger.exception("replica health poll failed")
            await asyncio.sleep(self.dp.health_interval)

    async def _poll(self, r: _Replica) -> None:
        try:
            st = await asyncio.wait_for(_await(r.actor.stats.remote()), timeout=max(2.0, 4 * self.dp.health_interval))
        except Exception as e:  # dead, restarting or stuck
            r.mark_down(e)
            return
        if st["incarnation"] != r.incarnation:  # restarted by Ray: a fresh engine with an empty cache
            logger.warning("replica %d restarted (pid %s -> %s)", r.index, r.pid, st["pid"])
            r.incarnation, r.pid = st["incarnation"], st["pid"]
            r.restarts += 1
            self.policy.replica_reset(r.index)
        r.stats, r.metrics_text = st["stats"], st["metrics"]
        if st["is_running"] and not r.healthy:
            logger.info("replica %d is healthy again", r.index)
        r.healthy = bool(st["is_running"])
        if not r.healthy:
            r.last_error = "engine loop is not running"

    # -- requests ---------------------------------------------------------------------------------------
    def _routing_ids(self, prompt: str | list[int]) -> list[int]:
        # Only a routing key: it must be the same for equal prompts, not identical to the engine's tokens.
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                          cache_salt: str | None = None, priority: int = 0) -> ReplicaStream:
        """Route and submit; returns once the replica accepted it (its ValueError otherwise). A replica found
        dead at submission is skipped and the request goes to another one."""
        if self._closed:
            raise EngineDeadError("engine is shut down")
        rid = request_id or uuid.uuid4().hex
        ids = self._routing_ids(prompt)
        estimate = len(ids) + (params.max_tokens or 0) * params.n
        for _ in range(len(self.replicas)):
            try:
                index = self.policy.choose(ids, [r.load() for r in self.replicas], cache_salt)
            except NoHealthyReplicaError as e:
                raise EngineDeadError(str(e)) from e
            r = self.replicas[index]
            gen = r.actor.generate.options(num_returns="streaming").remote(prompt, params, rid, cache_salt, priority)
            stream = ReplicaStream(rid, index, gen)
            r.in_flight[rid] = estimate
            try:
                await self._next(stream)  # the acceptance marker
            except ReplicaDiedError:
                self._release(stream)
                continue
            except BaseException:
                self._release(stream)
                stream.finished = True
                raise
            return stream
        raise EngineDeadError("no engine replica accepted the request")

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(prompt, params, request_id, cache_salt)
        async for out in self.outputs(stream):
            yield out

    async def outputs(self, stream: ReplicaStream) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs until the request finishes; leaving early aborts it on its replica."""
        try:
            while not stream.finished:
                try:
                    out = await self._next(stream)
                except StopAsyncIteration:
                    raise RequestFailedError(f"replica {stream.replica} ended the stream early") from None
                stream.finished = out.finished
                yield out
        finally:
            if not stream.finished:
                stream.finished = True
                self.abort(stream.request_id, stream.replica)
            self._release(stream)

    def abort(self, request_id: str, replica: int | None = None) -> None:
        """Non-blocking; the replica cancels the request's stream, which frees its blocks."""
        targets = [self.replicas[replica]] if replica is not None else \
            [r for r in self.replicas if request_id in r.in_flight]
        for r in targets:
            with contextlib.suppress(Exception):
                r.actor.abort.remote(request_id)

    def _release(self, stream: ReplicaStream) -> None:
        self.replicas[stream.replica].in_flight.pop(stream.request_id, None)

    async def _next(self, stream: ReplicaStream) -> Any:
        r = self.replicas[stream.replica]
        try:
            ref = await stream.gen.__anext__()
            return await ref
        except StopAsyncIteration:
            raise
        except RayTaskError as e:  # the replica raised: hand its own exception to the handlers
            cause = getattr(e, "cause", None)
            if isinstance(cause, BaseException):
                raise cause from None
            raise RequestFailedError(str(e)) from None
        except RayError as e:  # the actor died or is unreachable
            r.mark_down(e)
            raise ReplicaDiedError(f"engine replica {r.index} died while serving this request "
                                   f"({type(e).__name__})") from None

    async def kv_snapshot(self, replica: int = 0) -> dict[str, Any]:
        """One replica's block-pool picture for GET /kv?replica=i, marked with its index and the replica count."""
        if not 0 <= replica < len(self.replicas):
            raise ValueError(f"replica must be in [0, {len(self.replicas)}), got {replica}")
        r = self.replicas[replica]
        if not r.healthy:
            raise ReplicaDiedError(f"engine replica {replica} is down (restarting)")
        try:
            snap = await r.actor.kv_snapshot.remote()
        except RayError as e:
            r.mark_down(e)
            raise ReplicaDiedError(f"engine replica {replica} died ({type(e).__name__})") from None
        return {**snap, "replica": replica, "replicas": len(self.replicas)}

    async def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """Every healthy replica forgets its cached prefixes (reset_external: and its disk tier's); False if one of
        them holds blocks of a request (the others are reset anyway: a reset loses no request). The router's prefix
        table is dropped with them."""
        healthy = [r for r in self.replicas if r.healthy]
        done = await asyncio.gather(*(r.actor.reset_prefix_cache.remote(reset_external) for r in healthy),
                                    return_exceptions=True)
        for r, result in zip(healthy, done, strict=True):
            if isinstance(result, RayError):
                r.mark_down(result)
            if result is True:
                self.policy.replica_reset(r.index)
        return all(result is True for result in done)

    async def replica_kv_stats(self) -> list[dict | None]:
        """Each healthy replica's kv_cache_stats (None for the others)."""
        async def one(r: _Replica) -> dict | None:
            if not r.healthy:
                return None
            try:
                return await r.actor.kv_cache_stats.remote()
            except RayError:
                return None
        return list(await asyncio.gather(*(one(r) for r in self.replicas)))


async def _await(ref: Any) -> Any:
    return await ref
