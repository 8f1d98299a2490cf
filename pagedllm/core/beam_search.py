"""Beam search as a group of sequences on the paged cache: kept beams fork their parent's blocks, dropped beams
free theirs. The scheduler hands each beam's sampled row here (`BeamGroup.take_row`, from update_from_output);
once every live beam has its row, the group decides its advance and returns it as a `BeamStep`, which the scheduler
applies (forks, frees, appends): the group never changes a sequence itself.

Selection follows transformers' beam search (no sampling): each step takes the top 2*W continuations of all live
beams by cumulative log-probability (float32 sums, as transformers adds them); an EOS among the top W ends a
hypothesis with score sum_logprobs / generated_len ** length_penalty; the best W non-EOS continuations live on. A
group is done when W hypotheses are done and none of the live beams can beat the worst of them, or at max_tokens.
The runner reports each row's top 2*W tokens: the union of the beams' top 2*W holds the group's top 2*W.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.core.request import Request
from pagedllm.core.step import SamplerOutput


def f32(x: float) -> float:
    """x rounded to float32 (a sum of two float32 values computed in float64 and rounded once is the float32 sum)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass
class BeamStep:
    """One advance of a group, for the scheduler to apply in this order: fork each (parent, child) (the child built
    with the parent's tokens so far), finish the dropped beams, append each kept beam's token."""

    forks: list[tuple[Request, Request]] = field(default_factory=list)
    dropped: list[Request] = field(default_factory=list)
    appends: list[tuple[Request, int]] = field(default_factory=list)


@dataclass(eq=False)
class BeamGroup:
    width: int
    length_penalty: float
    eos_token_ids: frozenset[int]
    max_tokens: int  # generated tokens at most
    new_id: Callable[[], str]  # a fresh request id for a forked beam
    prompt_token_ids: list[int] = field(default_factory=list)
    beams: list[Request] = field(default_factory=list)
    scores: dict[int, float] = field(default_factory=dict)  # id(beam) -> cumulative log-probability
    finished: list[tuple[float, float, list[int]]] = field(default_factory=list)  # (score, cum_lp, tokens), best first
    pending: dict[int, list[tuple[float, int]]] = field(default_factory=dict)  # id(beam) -> its (logprob, token)s
    done: bool = False

    def start(self, prompt_token_ids: list[int], sampling_params: object) -> Request:
        """The group's first beam, for the scheduler (built as a beam of this group: nothing is set on it later)."""
        request = Request(self.new_id(), prompt_token_ids, sampling_params=sampling_params, beam=self)
        self.prompt_token_ids = request.prompt_token_ids
        self.beams, self.scores = [request], {id(request): 0.0}
        return request

    def take_row(self, beam: Request, sampled: SamplerOutput, row: int) -> BeamStep | None:
        """The beam's next-token candidates (its row's top 2W); once every beam has its own, the group's advance."""
        k = 2 * self.width
        self.pending[id(beam)] = list(zip(sampled.top_logprobs[row][:k], sampled.top_ids[row][:k], strict=True))
        if all(id(b) in self.pending for b in self.beams):
            return self._advance()
        return None

    def _keep(self, score: float, cum: float, tokens: list[int]) -> None:
        self.finished.append((score, cum, tokens))
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[self.width:]

    def _advance(self) -> BeamStep:
        width, pen = self.width, self.length_penalty
        candidates = [(f32(self.scores[id(b)] + lp), i, rank, token)
                      for i, b in enumerate(self.beams) for rank, (lp, token) in enumerate(self.pending.pop(id(b)))]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        gen_len = self.beams[0].num_output_tokens + 1  # generated length including the new token
        chosen: list[tuple[Request, int, float]] = []
        for rank, (score, i, _, token) in enumerate(candidates[:2 * width]):
            beam = self.beams[i]
            if token in self.eos_token_ids:
                if rank < width:
                    self._keep(score / gen_len**pen, score, beam.output_token_ids + [token])
                continue
            chosen.append((beam, token, score))
            if len(chosen) == width:
                break
        at_limit = gen_len >= self.max_tokens
        if at_limit:
            for beam, token, score in chosen:
                self._keep(score / gen_len**pen, score, beam.output_token_ids + [token])
        best_live = max((s for _, _, s in chosen), default=float("-inf")) / gen_len**pen
        if at_limit or not chosen or (len(self.finished) == width and self.finished[-1][0] >= best_live):
            step = BeamStep(dropped=self.beams)
            self.beams, self.scores, self.done = [], {}, True
            return step
        # A parent chosen again is forked once per extra child; unchosen parents are dropped.
        step = BeamStep()
        kept: list[tuple[Request, float]] = []  # (sequence, its score)
        used: set[int] = set()
        for beam, token, score in chosen:
            seq = beam
            if id(beam) in used:
                seq = Request(self.new_id(), beam.prompt_token_ids, output_token_ids=list(beam.output_token_ids),
                              sampling_params=beam.sampling_params, beam=self)
                step.forks.append((beam, seq))
            used.add(id(beam))
            kept.append((seq, score))
            step.appends.append((seq, token))
        step.dropped = [b for b in self.beams if id(b) not in used]
        self.beams = [seq for seq, _ in kept]
        self.scores = {id(seq): score for seq, score in kept}
        return step
