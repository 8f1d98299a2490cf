"""What the engine asks of structured outputs each step: the matcher each sample makes from a compiled grammar,
and the token bitmask of a step's constrained rows."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from pagedllm.core.request import Grammar
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.structured.backend import allow_token
from pagedllm.structured.reasoning_gate import GatedMatcher
from pagedllm.worker.sampler import TokenBitmask


def grammar_factory(manager: Callable, compiled: Future, params) -> Callable[[], Grammar]:
    """How each sample makes its own matcher from the compiled grammar (the scheduler calls it once the request is
    scheduled, so only after the compile is done). manager(): the engine's StructuredOutputManager."""
    gate = params.structured_outputs.after_reasoning  # (a reasoning model: free until it ends)

    def new_grammar() -> Grammar:
        matcher = manager().matcher(compiled.result())
        return matcher if gate is None else GatedMatcher(matcher, gate)

    return new_grammar


def token_bitmask(manager: Callable, scheduled: list[ScheduledRequest]) -> TokenBitmask | None:
    """The tokens each constrained row may take next (unconstrained rows are not in it): an entry with draft
    tokens gets one row per draft prefix (StructuredOutputManager.bitmask walks its matcher along the drafts and
    back: the request's grammar ends as it was, even when a fill fails); an entry that forks n samples, its
    matcher's one mask n times (every sample starts where the prompt ends). Behind a reasoning gate, rows are free
    while the model reasons, and its first row may also open the reasoning. manager(): as grammar_factory's."""
    rows, walks, repeats, extra, row = [], [], [], [], 0
    for s in scheduled:
        grammar = s.request.grammar
        if grammar is not None and s.num_rows and getattr(grammar, "masked", True):
            if getattr(grammar, "extra_token", None) is not None:
                extra.append((len(repeats), grammar.extra_token))  # the first mask row of this walk
            rows.extend(range(row, row + s.num_rows))
            walks.append((getattr(grammar, "matcher", grammar), [] if s.forks else s.draft_token_ids))
            repeats += [s.num_rows] if s.forks else [1] * s.num_rows
        row += s.num_rows
    if not rows:
        return None
    masks = manager().bitmask(walks)
    for mask_row, token in extra:
        allow_token(masks, mask_row, token)
    return TokenBitmask(rows, masks if len(masks) == len(rows) else np.repeat(masks, repeats, axis=0))
