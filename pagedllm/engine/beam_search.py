"""Beam search on the paged cache: kept beams fork their parent's blocks, dropped beams free theirs.

Selection follows transformers' beam search (no sampling): each step takes the top 2*W continuations of all
live beams by cumulative log-probability; an EOS among the top W ends a hypothesis with score
sum_logprobs / generated_len ** length_penalty; the best W non-EOS continuations live on. A request stops when
W hypotheses are done and none of the live beams can beat the worst of them, or at max_tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from pagedllm.core.request import Request, RequestStatus
from pagedllm.sampling_params import BeamSearchParams


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


@dataclass(eq=False)
class _Beam:
    request: Request
    score: float  # cumulative log-probability of the generated tokens


@dataclass(eq=False)
class _Group:
    prompt_token_ids: list[int]
    beams: list[_Beam]
    max_tokens: int
    finished: list[tuple[float, float, list[int]]] = field(default_factory=list)  # (score, cum_lp, tokens)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # id(request) -> logprobs [V]
    done: bool = False


def beam_search(engine, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
    if engine.has_unfinished_requests():
        raise RuntimeError("beam_search needs an idle engine")
    width, lp_pen = params.beam_width, params.length_penalty
    eos = set() if params.ignore_eos else engine.eos_token_ids
    ids = itertools.count()
    sched = engine.scheduler
    groups: list[_Group] = []
    group_of: dict[int, _Group] = {}
    for prompt in prompts:
        toks = engine.tokenize(prompt)
        max_tokens = sched.check_fits(len(toks), params.max_tokens)
        req = Request(f"beam-{next(ids)}", toks)
        sched.add_request(req)
        g = _Group(toks, [_Beam(req, 0.0)], max_tokens)
        groups.append(g)
        group_of[id(req)] = g

    def keep(g: _Group, score: float, cum: float, tokens: list[int]) -> None:
        g.finished.append((score, cum, tokens))
        g.finished.sort(key=lambda f: -f[0])
        del g.finished[width:]

    try:
        while not all(g.done for g in groups):
            out = sched.schedule()
            if out.is_empty and engine.wait_for_kv_loads():
                continue  # a beam's prefix is coming back from the disk tier
            if out.is_empty:
                raise RuntimeError("beam search cannot make progress: KV cache too small for the beams")
            sampling, logits = engine.run_model(out)
            logprobs = logits.float().log_softmax(-1)
            for row, s in enumerate(sampling):  # beams carry no draft tokens: one logits row each
                group_of[id(s.request)].pending[id(s.request)] = logprobs[row]
            for g in groups:
                if g.done or len(g.pending) < len(g.beams):
                    continue  # wait until every live beam of this request has its next-token logits
                _advance(g, width, lp_pen, eos, engine, group_of, ids, keep)
    finally:
        for g in groups:
            live = [b.request for b in g.beams if not b.request.status.is_finished]
            sched.finish_requests(live, RequestStatus.FINISHED_ABORTED)
    tok = engine.tokenizer
    return [BeamSearchOutput(g.prompt_token_ids,
                             [BeamSearchSequence(t, tok.decode(t, skip_special_tokens=True), cum, score)
                              for score, cum, t in g.finished]) for g in groups]


def _advance(g: _Group, width: int, lp_pen: float, eos: set[int], engine, group_of, ids, keep) -> None:
    lps = torch.stack([g.pending.pop(id(b.request)) for b in g.beams])
    vocab = lps.shape[1]
    scores = lps + torch.tensor([b.score for b in g.beams])[:, None]
    top_scores, top_idx = scores.flatten().topk(min(2 * width, scores.numel()))
    gen_len = g.beams[0].request.num_output_tokens + 1  # generated length including the new token
    max_tokens = g.max_tokens
    chosen: list[tuple[_Beam, int, float]] = []
    for rank, (s, idx) in enumerate(zip(top_scores.tolist(), top_idx.tolist(), strict=True)):
        beam, token = g.beams[idx // vocab], idx % vocab
        if token in eos:
            if rank < width:
                keep(g, s / gen_len**lp_pen, s, beam.request.output_token_ids + [token])
            continue
        chosen.append((beam, token, s))
        if len(chosen) == width:
            break
    at_limit = gen_len >= max_tokens
    if at_limit:
        for beam, token, s in chosen:
            keep(g, s / gen_len**lp_pen, s, beam.request.output_token_ids + [token])
    best_live = max((s for _, _, s in chosen), default=float("-inf")) / gen_len**lp_pen
    done = at_limit or not chosen or (len(g.finished) == width and g.finished[-1][0] >= best_live)
    sched = engine.scheduler
    if done:
        sched.finish_requests([b.request for b in g.beams], RequestStatus.FINISHED_STOPPED)
        g.beams, g.done = [], True
        return
    # Fork a parent once per extra child before any of them appends its token; free unchosen parents.
    new_beams: list[tuple[_Beam, int]] = []
    used: set[int] = set()
    for beam, token, s in chosen:
        req = beam.request
        if id(req) in used:
            child = Request(f"beam-{next(ids)}", req.prompt_token_ids, output_token_ids=list(req.output_token_ids))
            sched.fork(req, child)
            group_of[id(child)] = g
            req = child
        used.add(id(beam.request))
        new_beams.append((_Beam(req, s), token))
    dropped = [b.request for b in g.beams if id(b.request) not in used]
    sched.finish_requests(dropped, RequestStatus.FINISHED_STOPPED)
    for b, token in new_beams:
        b.request.append_output_token(token)
    g.beams = [b for b, _ in new_beams]
