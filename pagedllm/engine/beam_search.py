"""LLM.beam_search: beam groups (core/beam_search.py) run by the engine's own step loop.

Each prompt starts one beam-search group of one sequence. The engine steps as for any request: the runner
reports each beam's top 2 * beam_width next tokens (logprobs of the raw distribution), and the scheduler's
update hands them to the group, which decides which beams are kept (forked, sharing their blocks) and dropped and
when its hypotheses are done; the scheduler applies that.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pagedllm.core.beam_search import BeamGroup
from pagedllm.core.request import RequestStatus
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # generated tokens only
    text: str
    cum_logprob: float
    score: float  # cum_logprob / len(tokens) ** length_penalty


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best first


def beam_search(engine, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine.check_runner(pooling=False)
    sched = engine.scheduler
    if engine.has_unfinished_requests() or sched.running or sched.waiting:
        raise RuntimeError("beam_search needs an idle engine")
    width = params.beam_width
    eos = frozenset() if params.ignore_eos else frozenset(engine.eos_token_ids)
    ids = itertools.count()
    new_id = lambda: f"beam-{next(ids)}"  # noqa: E731
    # greedy rows (the group picks the tokens) that report their top 2W alternatives
    rows = SamplingParams(temperature=0.0, logprobs=2 * width)
    groups: list[BeamGroup] = []
    for prompt in prompts:
        toks = engine.tokenize(prompt)
        group = BeamGroup(width, params.length_penalty, eos, sched.check_fits(len(toks), params.max_tokens), new_id)
        group.start(toks, rows)  # its first beam
        groups.append(group)
    try:
        for g in groups:
            sched.add_request(g.beams[0])
        while not all(g.done for g in groups):
            before = engine.num_steps
            engine.step()
            if engine.num_steps == before and not engine.wait_for_kv_loads():  # (a prefix coming back from disk)
                raise RuntimeError("beam search cannot make progress: KV cache too small for the beams")
    finally:
        for g in groups:
            sched.finish_requests([b for b in g.beams if not b.status.is_finished], RequestStatus.FINISHED_ABORTED)
    tok = engine.tokenizer
    return [BeamSearchOutput(g.prompt_token_ids,
                             [BeamSearchSequence(t, tok.decode(t, skip_special_tokens=True), cum, score)
                              for score, cum, t in g.finished]) for g in groups]
