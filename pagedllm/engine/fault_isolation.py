"""A step that fails fails only the requests that fail by themselves: its requests are rerun in halves (K/V writes
are idempotent: same tokens, same slots) until each failing one runs alone. A request whose logits are not finite
(NaN or infinity: overflowing weights or activations) fails too, rather than sampling token 0."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.core.step import RunnerOutput, SamplerOutput

logger = logging.getLogger(__name__)


def execute_isolating_faults(execute: Callable[[list[ScheduledRequest]], RunnerOutput],
                             scheduled: list[ScheduledRequest],
                             fail: Callable[[ScheduledRequest, str], None]) -> RunnerOutput:
    """execute(group) runs a group of the step's entries; fail(entry, error) is told of each failed entry. Returns
    the step's rows in scheduled order (a failed entry's rows are placeholders)."""

    def check_finite(group: list[ScheduledRequest], result: RunnerOutput) -> None:
        for i in result.nonfinite:
            logger.error("request %s: its logits are not finite", group[i].request.request_id)
            fail(group[i], "model step failed: the model's logits for this request are not finite (NaN or "
                           "infinity): its weights or activations overflowed")

    try:
        result = execute(scheduled)
    except Exception:
        logger.exception("model step of %d requests failed; retrying them in smaller groups", len(scheduled))
    else:
        check_finite(scheduled, result)
        return result
    done: dict[int, tuple[RunnerOutput, int]] = {}  # id(entry) -> the output of its group, its first row

    def run(group: list[ScheduledRequest]) -> None:
        try:
            result = execute(group)
        except Exception as e:
            if len(group) > 1:
                run(group[:len(group) // 2])
                run(group[len(group) // 2:])
                return
            logger.exception("request %s fails the model step alone", group[0].request.request_id)
            fail(group[0], f"model step failed: {type(e).__name__}: {e}")
            return
        check_finite(group, result)
        row = 0
        for s in group:
            done[id(s)] = (result, row)
            row += s.num_rows

    run(scheduled)
    return _merge_rows(scheduled, done)


def _merge_rows(scheduled: list[ScheduledRequest], done: dict[int, tuple[RunnerOutput, int]]) -> RunnerOutput:
    """One RunnerOutput from the groups of a retried step, in scheduled order; an entry that failed gets
    placeholder rows (its sequences are aborted)."""
    merged = RunnerOutput()
    sampled = merged.sampled = SamplerOutput([], [], [], [], [])
    with_logprobs = False
    for s in scheduled:
        result, first = done.get(id(s), (None, 0))
        if result is not None:
            merged.prompt_logprobs.update(result.prompt_logprobs)
            merged.pooled.update(result.pooled)
        for r in range(first, first + s.num_rows):
            src = result.sampled if result is not None else None
            sampled.token_ids.append(src.token_ids[r] if src is not None else -1)
            has = src is not None and src.logprobs is not None
            with_logprobs |= has
            sampled.logprobs.append(src.logprobs[r] if has else 0.0)
            sampled.ranks.append(src.ranks[r] if has else 0)
            sampled.top_ids.append(src.top_ids[r] if has and src.top_ids is not None else [])
            sampled.top_logprobs.append(src.top_logprobs[r] if has and src.top_logprobs is not None else [])
    if not with_logprobs:
        sampled.logprobs = sampled.ranks = sampled.top_ids = sampled.top_logprobs = None
    return merged
