"""Router simulation: a multi-turn chat trace through the real routing policies over simulated replicas, each
with the engine's real Scheduler and KVCacheManager (pure Python, no model, no Ray).

Time is simulated: a replica step costs `StepCost` seconds for the tokens it computes, so prefix-cache hits
(tokens not recomputed) make steps shorter. The trace: conversations of several turns, each opening with one of
a set of shared system prompts drawn with a Zipf popularity; turn k's prompt is the whole conversation so far
(system prompt, earlier user messages and replies) plus the new user message, and it arrives a think time
after turn k-1 finished.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.core.step import SamplerOutput
from pagedllm.distributed.routing import ReplicaLoad, RoutingPolicy


@dataclass
class TraceConfig:
    num_conversations: int = 256
    num_system_prompts: int = 32
    zipf_s: float = 1.1  # popularity of system prompts: P(rank k) ~ 1 / k^s
    system_len: tuple[int, int] = (256, 1024)
    user_len: tuple[int, int] = (16, 128)
    reply_len: tuple[int, int] = (16, 64)
    turns: tuple[int, int] = (1, 6)
    arrival_rate: float = 8.0  # new conversations per simulated second
    think_time: float = 3.0  # mean seconds between a reply and the next user message
    seed: int = 0


@dataclass
class Conversation:
    start: float
    system: list[int]
    turns: list[tuple[list[int], list[int]]]  # (user message, reply) token ids


def make_trace(cfg: TraceConfig) -> list[Conversation]:
    rng = random.Random(cfg.seed)
    tok = itertools.count(1000)  # every segment gets fresh ids: only real shared prefixes are shared

    def segment(lo_hi: tuple[int, int]) -> list[int]:
        return [next(tok) for _ in range(rng.randint(*lo_hi))]

    systems = [segment(cfg.system_len) for _ in range(cfg.num_system_prompts)]
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.num_system_prompts)]
    t, convs = 0.0, []
    for _ in range(cfg.num_conversations):
        t += rng.expovariate(cfg.arrival_rate)
        system = rng.choices(systems, weights)[0]
        turns = [(segment(cfg.user_len), segment(cfg.reply_len)) for _ in range(rng.randint(*cfg.turns))]
        convs.append(Conversation(t, system, turns))
    return convs


@dataclass
class StepCost:
    """Seconds per engine step: fixed overhead + per computed token + per attended context token."""

    fixed: float = 0.010
    per_token: float = 0.0004
    per_context_token: float = 0.000002

    def __call__(self, out: SchedulerOutput) -> float:
        tokens = _batched_tokens(out)
        context = sum(s.request.num_computed_tokens + s.num_new_tokens for s in out.scheduled)
        return self.fixed + self.per_token * tokens + self.per_context_token * context


@dataclass
class ReplicaConfig:
    num_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 16384


@dataclass(eq=False)
class _Turn:
    conv: int
    index: int
    prompt: list[int]
    reply: list[int]
    arrival: float
    replica: int = -1
    first_token: float | None = None
    request: Request | None = None


class SimReplica:
    def __init__(self, cfg: ReplicaConfig) -> None:
        self.kv = KVCacheManager(cfg.num_blocks, cfg.block_size)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                                   cfg.max_model_len), self.kv)
        self.turns: dict[int, _Turn] = {}  # id(Request) -> turn
        self.busy = False
        self.pending: SchedulerOutput | None = None
        self.computed_tokens = 0
        self.busy_time = 0.0

    def add(self, turn: _Turn, rid: str) -> None:
        self.scheduler.check_fits(len(turn.prompt), len(turn.reply))  # as the engine does at add time
        req = Request(rid, turn.prompt, max_tokens=len(turn.reply))
        turn.request = req
        self.turns[id(req)] = turn
        self.scheduler.add_request(req)

    def queued_tokens(self) -> int:
        """Tokens still to compute: unprocessed prompt plus replies still to generate."""
        return sum(len(t.prompt) + len(t.reply) - t.request.num_computed_tokens for t in self.turns.values())

    def load(self) -> ReplicaLoad:
        s = self.scheduler
        return ReplicaLoad(True, len(s.running) + len(s.waiting), self.queued_tokens(), self.kv.usage())

    def start_step(self) -> SchedulerOutput | None:
        out = self.scheduler.schedule()
        if out.is_empty:
            return None
        self.pending = out
        self.computed_tokens += _batched_tokens(out)
        return out

    def finish_step(self, now: float) -> list[_Turn]:
        """Apply the step: each request whose prompt is done gets its next reply token; finished turns out."""
        out, self.pending = self.pending, None
        done = []
        rows = [self.turns[id(s.request)].reply[s.request.num_output_tokens] for s in out.scheduled if s.num_rows]
        for update in self.scheduler.update_from_output(out, SamplerOutput(rows)):
            turn = self.turns[id(update.request)]
            if turn.first_token is None:
                turn.first_token = now
            if update.finished:  # its max_tokens is its reply's length
                del self.turns[id(update.request)]
                done.append(turn)
        return done


@dataclass
class SimResult:
    policy: str
    replicas: int
    requests: int
    hit_rate: float  # prompt tokens served from the prefix cache / prompt tokens looked up
    imbalance: float  # max / mean over replicas of their mean queued tokens (sampled at arrivals)
    throughput: float  # prompt + generated tokens per second of the replicas' mean busy time: the rate the
    #                    cluster sustains when kept busy (cache hits shorten steps)
    ttft_p50: float
    ttft_p99: float
    makespan: float
    preemptions: int
    extra: dict = field(default_factory=dict)


def simulate(trace: Sequence[Conversation], policy: RoutingPolicy, num_replicas: int,
             replica_cfg: ReplicaConfig | None = None, cost: StepCost | None = None,
             think_time: float = 3.0, seed: int = 0) -> SimResult:
    rcfg, cost = replica_cfg or ReplicaConfig(), cost or StepCost()
    rng = random.Random(seed)
    reps = [SimReplica(rcfg) for _ in range(num_replicas)]
    events: list[tuple[float, int, str, int, _Turn | None]] = []  # (time, seq, kind, replica, turn)
    seq = itertools.count()
    for c, conv in enumerate(trace):
        heapq.heappush(events, (conv.start, next(seq), "arrive", -1, _turn(trace, c, 0, conv.start)))
    finished: list[_Turn] = []
    queued_sum, now = [0] * num_replicas, 0.0  # Poisson arrivals see time averages

    def kick(i: int) -> None:
        if not reps[i].busy and (out := reps[i].start_step()) is not None:
            reps[i].busy = True
            dt = cost(out)
            reps[i].busy_time += dt
            heapq.heappush(events, (now + dt, next(seq), "step", i, None))

    while events:
        now, _, kind, i, turn = heapq.heappop(events)
        if kind == "arrive":
            loads = [r.load() for r in reps]
            for r, ld in enumerate(loads):
                queued_sum[r] += ld.queued_tokens
            turn.replica = policy.choose(turn.prompt, loads)
            reps[turn.replica].add(turn, f"{turn.conv}-{turn.index}")
            kick(turn.replica)
            continue
        reps[i].busy = False
        for t in reps[i].finish_step(now):
            finished.append(t)
            if t.index + 1 < len(trace[t.conv].turns):
                at = now + rng.expovariate(1.0 / think_time) if think_time > 0 else now
                heapq.heappush(events, (at, next(seq), "arrive", -1, _turn(trace, t.conv, t.index + 1, at)))
        kick(i)
    stats = [r.kv.stats() for r in reps]
    queries = sum(s["prefix_cache_queries"] for s in stats)
    hits = sum(s["prefix_cache_hits"] for s in stats)
    ttft = sorted(t.first_token - t.arrival for t in finished)
    delivered = sum(len(t.prompt) + len(t.reply) for t in finished)
    return SimResult(policy.name, num_replicas, len(finished), hits / queries if queries else 0.0,
                     max(queued_sum) * num_replicas / sum(queued_sum) if sum(queued_sum) else 1.0,
                     delivered * num_replicas / busy if (busy := sum(r.busy_time for r in reps)) else 0.0,
                     _pct(ttft, 0.5), _pct(ttft, 0.99), now, sum(r.scheduler.num_preemptions for r in reps),
                     {"computed_tokens": sum(r.computed_tokens for r in reps),
                      "leaked_blocks": sum(s["num_blocks"] - s["num_free_blocks"] for s in stats)})


def _turn(trace: Sequence[Conversation], c: int, k: int, arrival: float) -> _Turn:
    conv = trace[c]
    prompt = list(conv.system)
    for user, reply in conv.turns[:k]:
        prompt += user + reply
    prompt += conv.turns[k][0]
    return _Turn(c, k, prompt, conv.turns[k][1], arrival)


def _batched_tokens(out: SchedulerOutput) -> int:
    return sum(s.num_new_tokens for s in out.scheduled)


def _pct(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
