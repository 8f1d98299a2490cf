"""AsyncEngine: drives one LLMEngine from a background thread and streams outputs to asyncio tasks.

The LLMEngine is not thread-safe, so exactly one thread (the loop thread) ever touches it: asyncio code posts
commands (add, abort, arbitrary calls) into a thread-safe queue that the loop drains between steps, and the
loop hands each RequestOutput to the request's asyncio queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pagedllm.engine.request_stream import EngineDeadError, RequestFailedError, RequestStream, Tracked
from pagedllm.faults import as_exception, is_request_fault
from pagedllm.lora.request import LoRANotFoundError, LoRARequest
from pagedllm.metrics import EngineMetrics, StatsLogger
from pagedllm.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput, completions_of
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # (llm_engine imports torch and the model code: only the type here)
    from pagedllm.engine.args import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")  # what a call()'s function returns


SWITCH_INTERVAL_S = 0.0005


def _snapshot(out: RequestOutput | EmbeddingRequestOutput) -> RequestOutput | EmbeddingRequestOutput:
    """Copy the mutable lists, so that the engine may keep appending to its own while we stream (an embedding
    is reported once, finished)."""
    if not isinstance(out, RequestOutput):
        return out
    outs = [dataclasses.replace(c, token_ids=list(c.token_ids),
                                logprobs=None if c.logprobs is None else list(c.logprobs))
            for c in out.outputs]
    plp = None if out.prompt_logprobs is None else list(out.prompt_logprobs)
    return dataclasses.replace(out, outputs=outs, prompt_logprobs=plp)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None, *,
                 stats_interval: float = 0.05, log_stats_interval: float | None = None,
                 log_requests: bool = False, log_prompts: bool = False) -> None:
        """log_stats_interval: seconds between the INFO stats lines (None: none). log_requests: one INFO line
        per request added (id, prompt length, parameters; the prompt itself only with log_prompts) and
        finished (finish reasons, lengths)."""
        self.engine = engine
        self.metrics = metrics if metrics is not None else EngineMetrics(engine.model_name)
        self.stats_interval = stats_interval
        self.stats_logger = StatsLogger(log_stats_interval) if log_stats_interval else None
        self.log_requests = log_requests
        self.log_prompts = log_prompts
        self._token_totals = [0, 0]  # prompt, generation tokens (for the stats line)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._tracked: dict[str, Tracked] = {}  # loop thread only
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()  # guards _closed against commands posted while the loop exits
        self._closed = False
        self._last_stats = 0.0
        self._stats: dict = {}
        self.dead_error: BaseException | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **options: Any) -> AsyncEngine:
        from pagedllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(engine_args), **options)

    # -- read-only facts of the model ---------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def runner_name(self) -> str:
        return self.engine.runner_name

    @property
    def task(self) -> str:
        """"score": a cross-encoder (scores pairs of texts), "embed": an embedding model (or a generator)."""
        return getattr(self.engine, "task", "embed")

    @property
    def generation_defaults(self) -> dict:
        return getattr(self.engine, "generation_defaults", {})

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> str:
        # Pure function of the tokenizer: safe to call outside the loop thread.
        return self.engine.apply_chat_template(messages, **kwargs)

    async def compile_grammar(self, structured_outputs: Any) -> None:
        """Compile a request's constraint (or find it cached) on the engine's compile thread, so that an invalid
        one is an error for that request before it is added; raises GrammarError (a ValueError)."""
        await asyncio.wrap_future(self.engine.structured_outputs.submit(structured_outputs))

    # -- life cycle -----------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> None:
        if self._thread is not None:
            return
        # The engine thread and the event loop share the GIL: when the loop holds it (streaming, JSON), the engine
        # waits for the interpreter's switch interval between kernels, 5 ms by default: a decode step's worth on
        # a small model. 0.5 ms keeps the waits short (BENCHMARKS.md, serving under load: one user).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight end with EngineDeadError."""
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- asyncio API ----------------------------------------------------------------------------------------
    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                          cache_salt: str | None = None, prompt_token_ids: list[int] | None = None,
                          priority: int = 0, lora_request: LoRARequest | None = None) -> RequestStream:
        """Submit a request; returns once the engine has accepted it (raises its ValueError otherwise).
        `prompt_token_ids`: the text prompt already tokenized, so the loop thread does not. `priority`: lower
        first under the priority scheduling policy. `lora_request`: an adapter loaded by add_lora (or
        preload_lora); LoRANotFoundError if it is not loaded any more."""
        if not self.is_running:
            raise EngineDeadError("engine is not running") from self.dead_error
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id or uuid.uuid4().hex, loop, accepted=loop.create_future(),
                               on_abandon=self.abort)
        arrival = time.monotonic()
        self._post(lambda: self._do_add(stream, prompt, params, cache_salt, arrival, prompt_token_ids, priority,
                                        lora_request))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(stream.request_id)
            stream.finished = True
            raise
        except BaseException:
            stream.finished = True  # rejected: nothing to abort (the id may belong to another request)
            raise
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes; cancellation or closing aborts it."""
        stream = await self.add_request(prompt, params, request_id, cache_salt)
        async for out in self.outputs(stream):
            yield out

    async def outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Iterate a request's outputs; leaving early (cancel, error, close) aborts it in the engine."""
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe and non-blocking; the blocks are freed before the next engine step."""
        try:
            self._post(lambda: self._do_abort(request_id))
        except EngineDeadError:
            pass  # nothing left to free

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) in the loop thread between two steps and return its result."""
        if not self.is_running:
            raise EngineDeadError("engine is not running") from self.dead_error
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._post(run)
        return await fut

    # -- LoRA adapters ----------------------------------------------------------------------------------------
    @property
    def lora_enabled(self) -> bool:
        return self.engine.loras is not None  # (set once at construction: safe to read from any thread)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter (ValueError / InvalidModelError naming what is wrong with it): its files are read in a
        worker thread, so that neither the event loop nor the engine's steps wait on the disk; then it is added
        in the loop thread, between two steps."""
        read = await asyncio.to_thread(self.engine.read_lora, lora_request)
        await self.call(lambda e: e.add_lora(lora_request, read))

    async def remove_lora(self, lora_name: str) -> bool:
        """Unload an adapter; its running requests finish with it. False if it is not loaded."""
        return await self.call(lambda e: e.remove_lora(lora_name))

    def preload_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter before start() (the server's --lora-modules): in this thread, as no loop runs yet."""
        if self._thread is not None:
            raise RuntimeError("preload_lora is for before start(); a running engine loads through add_lora")
        self.engine.add_lora(lora_request)

    async def kv_cache_stats(self) -> dict:
        return await self.call(lambda e: e.kv_cache_stats())

    async def kv_snapshot(self, replica: int = 0) -> dict:
        """The block pool's picture for GET /kv (engine/kv_snapshot.py); one engine: replica 0 only."""
        from pagedllm.engine.kv_snapshot import kv_snapshot

        if replica != 0:
            raise ValueError(f"replica must be 0 (this server runs one engine), got {replica}")
        if not hasattr(self.engine, "kv"):
            raise ValueError("this engine runs an encoder, which has no KV cache")
        return await self.call(kv_snapshot)

    async def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """Forget every cached prefix block (reset_external: the disk tier's too); False (nothing changed) while
        requests hold blocks."""
        return await self.call(lambda e: e.reset_prefix_cache(reset_external))

    def cached_stats(self) -> dict:
        """The newest stats snapshot taken by the loop (no waiting; may be up to stats_interval old)."""
        return dict(self._stats)

    # -- loop thread ----------------------------------------------------------------------------------------
    def _post(self, command: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise EngineDeadError("engine is not running") from self.dead_error
            self._commands.put(command)
        self._wakeup.set()

    def _drain(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # a command must never kill the loop
                logger.exception("engine command failed")

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain()
                if self.engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    if not self._step() and time.perf_counter() - t0 < 1e-3:
                        # nothing could be scheduled: do not spin, wait a little for an add or abort
                        self._wakeup.wait(0.005)
                        self._wakeup.clear()
                    self._refresh_stats(force=False)
                else:
                    self._refresh_stats(force=True)
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
        except BaseException as e:  # the loop itself broke: fail everyone loudly
            logger.exception("engine loop crashed")
            self.dead_error = e
        finally:
            self._stop.set()
            with self._lock:
                self._closed = True
            # Run what was posted before closing (adds must not hang their callers), then fail everyone.
            self._drain()
            err = EngineDeadError("engine shut down")
            if self.dead_error is not None:
                err.__cause__ = self.dead_error
            self._fail_all(err)
            try:  # in this thread, the only one that touches the engine: e.g. write the disk tier's blocks
                getattr(self.engine, "close", lambda: None)()
            except Exception:
                logger.exception("closing the engine failed")

    def _step(self) -> bool:
        """One engine step; False when it produced no output."""
        try:
            outputs = self.engine.step()
        except BaseException as e:
            if not is_request_fault(e):
                raise
            # We cannot tell which request broke the step: fail those in flight, keep the engine serving.
            logger.exception("engine step failed; aborting %d in-flight requests", len(self._tracked))
            self._fail_all(RequestFailedError(f"engine step failed: {type(e).__name__}: {e}"))
            return True
        now = time.monotonic()
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:  # aborted meanwhile
                continue
            if getattr(out, "error", None):  # the engine failed this request alone (and already freed it)
                self._fail(out.request_id, RequestFailedError(out.error))
                continue
            try:
                self._record(tracked, out, now)
                tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, _snapshot(out))
            except Exception as e:  # only this request fails
                logger.exception("processing output of %s failed", out.request_id)
                self._fail(out.request_id, RequestFailedError(f"{type(e).__name__}: {e}"))
                continue
            if out.finished:
                del self._tracked[out.request_id]
        return bool(outputs)

    def _record(self, t: Tracked, out: RequestOutput, now: float) -> None:
        m = self.metrics
        if not t.counted_prompt:
            t.counted_prompt = True
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            self._token_totals[0] += len(out.prompt_token_ids)
        if out.finished:
            m.observe_finished(out)
            if self.log_requests:
                logger.info("Finished request %s: finish_reason=%s, prompt %d tokens, output %s tokens",
                            out.request_id, [c.finish_reason for c in completions_of(out)],
                            len(out.prompt_token_ids), [len(c.token_ids) for c in completions_of(out)])
        num_tokens = sum(len(c.token_ids) for c in completions_of(out))
        new = num_tokens - t.num_tokens
        if new <= 0:
            return
        t.num_tokens = num_tokens
        self._token_totals[1] += new
        m.generation_tokens.inc(new)
        if t.first_token_time is None:
            t.first_token_time = now
            m.ttft.observe(now - t.arrival)
        elif t.last_token_time is not None:
            m.itl.observe(now - t.last_token_time)
        t.last_token_time = now

    def _do_add(self, stream: RequestStream, prompt: str | list[int], params: SamplingParams,
                cache_salt: str | None, arrival: float, prompt_token_ids: list[int] | None = None,
                priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        rid = stream.request_id
        try:
            if rid in self._tracked:
                raise ValueError(f"request_id {rid!r} is already in use")
            if lora_request is not None and lora_request not in self.engine.list_loras():
                raise LoRANotFoundError(lora_request.lora_name)  # unloaded meanwhile: not loaded back on first use
            extra: dict[str, Any] = {} if prompt_token_ids is None else {"prompt_token_ids": prompt_token_ids}
            if lora_request is not None:
                extra["lora_request"] = lora_request
            self.engine.add_request(rid, prompt, params, cache_salt=cache_salt, arrival_time=arrival, priority=priority,
                                    **extra)
        except BaseException as e:  # native panics included: they fail this request, not the engine loop
            if not is_request_fault(e):
                raise
            stream.loop.call_soon_threadsafe(_set_exception, stream.accepted, as_exception(e, "adding the request"))
            return
        if self.log_requests:
            state = self.engine.requests.get(rid)
            logger.info("Added request %s: prompt %d tokens, params %s%s", rid,
                        len(state.prompt_token_ids) if state is not None else -1, params,
                        f", prompt {prompt!r}" if self.log_prompts else "")
        self._tracked[rid] = Tracked(stream.loop, stream.queue, arrival)
        stream.loop.call_soon_threadsafe(_set_result, stream.accepted, None)

    def _do_abort(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self.engine.abort_request(request_id)
        self._refresh_stats(force=True)

    def _fail(self, request_id: str, error: BaseException) -> None:
        tracked = self._tracked.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort of %s failed", request_id)
        if tracked is not None:
            with contextlib.suppress(RuntimeError):  # the consumer's event loop is gone: nobody to tell
                tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, error)

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self._tracked):
            self._fail(rid, error)

    def _refresh_stats(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats < self.stats_interval:
            return
        self._last_stats = now
        try:
            stats = dict(self.engine.kv_cache_stats())
            stats["num_running"] = self.engine.num_running()
            stats["num_waiting"] = self.engine.num_waiting()
        except Exception:
            logger.exception("reading engine stats failed")
            return
        self._stats = stats
        self.metrics.update_engine_stats(stats, stats["num_running"], stats["num_waiting"])
        if self.stats_logger is not None:
            self.stats_logger.maybe_log(stats, *self._token_totals, now=now)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


__all__ = ["AsyncEngine", "CompletionOutput", "EngineDeadError", "RequestFailedError", "RequestOutput",
           "RequestStream"]
