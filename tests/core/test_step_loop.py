"""The step loop without a model: schedule -> execute -> update, with scripted sampled rows.

Covers what Scheduler.update_from_output owns (forking n samples, draft acceptance and KV rollback, which stop
ends a sequence, beam advance) and the model runner's batch flattening (a fake model that records its inputs).
Every scenario checks the block pool afterwards: no block leaks."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.core.beam_search import BeamGroup
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from pagedllm.core.step import SamplerOutput
from pagedllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 256, max_model_len: int = 256):
    kv = KVCacheManager(num_blocks, block_size, max_model_len=max_model_len)
    return Scheduler(SchedulerConfig(16, budget, max_model_len), kv)


def seq(rid: str, prompt_len: int, **fields) -> Request:
    rng = random.Random(rid)
    return Request(rid, [rng.randrange(100, 10_000) for _ in range(prompt_len)], sampling_params=GREEDY, **fields)


def step(sched: Scheduler, rows_for):
    """One step: rows_for(entry) gives the sampled tokens of an entry's rows."""
    out = sched.schedule()
    rows = [t for s in out.scheduled for t in (rows_for(s) if s.num_rows else [])]
    assert len(rows) == sum(s.num_rows for s in out.scheduled)
    return out, sched.update_from_output(out, SamplerOutput(rows))


def assert_released(sched: Scheduler) -> None:
    assert not sched.running and not sched.waiting
    assert sched.kv.num_free_blocks() == sched.kv.num_blocks


class FakeGrammar:
    """Accepts tokens below `limit`; complete after `length` tokens."""

    def __init__(self, limit: int = 50, length: int = 10**9) -> None:
        self.limit, self.length, self.taken = limit, length, []

    def accept(self, token: int) -> bool:
        if token >= self.limit:
            return False
        self.taken.append(token)
        return True

    def is_terminated(self) -> bool:
        return len(self.taken) >= self.length


# ---- fork -------------------------------------------------------------------------------------------------------
def test_fork_after_prefill_shares_blocks_seeds_and_grammars():
    sched = make_scheduler()
    grammars = []

    def new_grammar():
        grammars.append(FakeGrammar())
        return grammars[-1]

    parent = seq("r#0", 10, seed=7, max_tokens=3, fork_ids=["r#1", "r#2"], new_grammar=new_grammar)
    sched.add_request(parent)
    assert parent.grammar is grammars[0]  # the scheduler makes the first sample's matcher too
    out, updates = step(sched, lambda s: [11, 12, 13])
    assert [s.num_rows for s in out.scheduled] == [3] and out.scheduled[0].forks
    assert [u.request.request_id for u in updates] == ["r#0", "r#1", "r#2"]
    assert [u.token_ids for u in updates] == [[11], [12], [13]]
    assert [u.forked_from for u in updates] == [None, parent, parent]
    children = [u.request for u in updates[1:]]
    assert [c.seed for c in children] == [8, 9] and parent.fork_ids == []
    assert [g.taken for g in grammars] == [[11], [12], [13]]  # each sample walks its own matcher
    ids = [sched.kv.get_block_ids(r) for r in (parent, *children)]
    assert ids[0][:2] == ids[1][:2] == ids[2][:2]  # the two full prompt blocks are shared
    assert all(r.num_computed_tokens == 10 for r in (parent, *children))
    # the next step: one row each, no more forks; they run to max_tokens
    while sched.running:
        out, _ = step(sched, lambda s: [20] * s.num_rows)
        assert not any(s.forks for s in out.scheduled)
    assert [r.output_token_ids for r in (parent, *children)] == [[11, 20, 20], [12, 20, 20], [13, 20, 20]]
    assert_released(sched)


# ---- drafts -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("accepted", [0, 1, 3, 5])
def test_drafts_keep_the_accepted_prefix_and_give_back_the_rest(accepted):
    sched = make_scheduler(block_size=4)
    r = seq("d", 6, max_tokens=50)
    sched.add_request(r)
    step(sched, lambda s: [1])  # prefill + first token
    drafts = [31, 32, 33, 34, 35]
    sched.update_draft_token_ids({"d": list(drafts)})
    before = r.num_tokens
    rows = drafts[:accepted] + [77] + [90] * (len(drafts) - accepted)  # row `accepted` differs from its draft
    out, (u,) = step(sched, lambda s: rows[:s.num_rows])
    assert out.scheduled[0].draft_token_ids == drafts
    assert u.num_draft_tokens == 5 and u.num_accepted_tokens == accepted
    assert u.token_ids == drafts[:accepted] + [77] and r.output_token_ids[1:] == u.token_ids
    # K/V kept for the known tokens and the accepted drafts; the rejected drafts' slots are released
    assert r.num_computed_tokens == before + accepted and not r.spec_token_ids
    assert len(sched.kv.get_block_ids(r)) == -(-r.num_computed_tokens // 4)
    assert sched.kv.stats()["used_slots"] == r.num_computed_tokens
    sched.finish_requests([r], RequestStatus.FINISHED_ABORTED)
    assert_released(sched)


def test_a_stop_inside_a_draft_ends_the_sequence_there():
    sched = make_scheduler()
    r = seq("s", 5, max_tokens=50, eos_token_ids=frozenset({2}))
    sched.add_request(r)
    step(sched, lambda s: [9])
    sched.update_draft_token_ids({"s": [40, 2, 41]})
    _, (u,) = step(sched, lambda s: [40, 2, 41, 42])  # every draft "accepted", but EOS is the second
    assert u.token_ids == [40, 2] and u.finished and r.status == RequestStatus.FINISHED_STOPPED
    assert_released(sched)


def test_update_draft_token_ids_sets_running_requests_only():
    sched = make_scheduler()
    a, b, waiting = seq("a", 5, max_tokens=50), seq("b", 5, max_tokens=50), seq("w", 5)
    for r in (a, b):
        sched.add_request(r)
    step(sched, lambda s: [9])
    sched.add_request(waiting)
    sched.update_draft_token_ids({"a": [1, 2], "b": [3], "w": [4], "gone": [5]})
    assert (a.spec_token_ids, b.spec_token_ids, waiting.spec_token_ids) == ([1, 2], [3], [])
    sched.update_draft_token_ids({"b": []})  # an empty draft clears; a request not named keeps its own
    assert (a.spec_token_ids, b.spec_token_ids) == ([1, 2], [])
    sched.finish_requests([a, b, waiting], RequestStatus.FINISHED_ABORTED)
    assert_released(sched)


# ---- which stop wins ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["stop_token", "eos", "grammar_end", "length", "context", "grammar_reject"])
def test_which_stop_ends_a_sequence(case):
    """One token that ends the sequence several ways at once: stop token, then EOS / a complete grammar, then
    length (max_tokens or the context); a token the grammar rejects fails the sequence."""
    sched = make_scheduler(max_model_len=12)
    stop_ids = frozenset({5}) if case == "stop_token" else frozenset()
    eos = frozenset({5}) if case in ("stop_token", "eos") else frozenset()
    grammar = FakeGrammar(limit=6 if case == "grammar_reject" else 50,
                          length=2 if case in ("stop_token", "eos", "grammar_end") else 10**9)
    max_tokens = 2 if case != "context" else 40
    r = seq("w", 10, max_tokens=max_tokens, stop_token_ids=stop_ids, eos_token_ids=eos, grammar=grammar)
    sched.add_request(r)
    step(sched, lambda s: [3])
    _, (u,) = step(sched, lambda s: [5 if case != "grammar_reject" else 7])
    want = {"stop_token": (RequestStatus.FINISHED_STOPPED, 5), "eos": (RequestStatus.FINISHED_STOPPED, None),
            "grammar_end": (RequestStatus.FINISHED_STOPPED, None), "length": (RequestStatus.FINISHED_LENGTH, None),
            "context": (RequestStatus.FINISHED_LENGTH, None), "grammar_reject": (RequestStatus.FINISHED_ABORTED, None)}
    assert (r.status, r.stop_reason) == want[case]
    if case == "grammar_reject":
        assert "rejected token 7" in r.error and u.token_ids == [] and r.output_token_ids == [3]
    assert_released(sched)


def test_a_sequence_aborted_while_its_step_ran_is_skipped():
    sched = make_scheduler()
    a, b = seq("a", 5, max_tokens=9), seq("b", 5, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.finish_requests([a], RequestStatus.FINISHED_ABORTED)
    updates = sched.update_from_output(out, SamplerOutput([-1, 44]))  # a's row is a placeholder
    assert [(u.request, u.token_ids) for u in updates] == [(b, [44])] and a.output_token_ids == []
    sched.finish_requests([b], RequestStatus.FINISHED_ABORTED)
    assert_released(sched)


# ---- beam advance ---------------------------------------------------------------------------------------------
def beam_step(sched: Scheduler, candidates_of) -> None:
    out = sched.schedule()
    order = [s.request for s in out.scheduled if s.num_rows]
    top = [candidates_of(r) for r in order]
    sampled = SamplerOutput([0] * len(order), [0.0] * len(order), [1] * len(order),
                            [[t for _, t in c] for c in top], [[lp for lp, _ in c] for c in top])
    assert sched.update_from_output(out, sampled) == []  # beams are the group's, not reported


def test_beam_group_forks_kept_beams_frees_dropped_ones_and_keeps_eos_hypotheses():
    sched = make_scheduler()
    ids = iter(range(100))
    group = BeamGroup(2, 1.0, frozenset({2}), 3, lambda: f"b{next(ids)}")
    root = group.start(seq("root", 6).prompt_token_ids, GREEDY)
    assert root.beam is group and group.beams == [root]
    sched.add_request(root)
    # step 1: one beam; its top 4: 10 (-0.1), 11 (-0.2), EOS (-0.3), 12 (-0.4): beams 10 and 11 (a fork)
    beam_step(sched, lambda r: [(-0.1, 10), (-0.2, 11), (-0.3, 2), (-0.4, 12)])
    assert [b.output_token_ids for b in group.beams] == [[10], [11]] and not group.finished
    assert sched.kv.get_block_ids(group.beams[0])[0] == sched.kv.get_block_ids(group.beams[1])[0]  # shared prompt
    # step 2: beam [10] offers EOS best (-0.05): a finished hypothesis; [11]'s continuations win the live slots
    scripted = {10: [(-0.05, 2), (-3.0, 20), (-3.1, 21), (-3.2, 22)], 11: [(-0.1, 30), (-0.2, 31), (-5, 32), (-6, 33)]}
    beam_step(sched, lambda r: scripted[r.output_token_ids[0]])
    assert [b.output_token_ids for b in group.beams] == [[11, 30], [11, 31]]
    assert group.finished == [(pytest.approx(-0.15 / 2), pytest.approx(-0.15), [10, 2])]
    # step 3 reaches max_tokens: the live beams become hypotheses, the best two kept, every block freed
    beam_step(sched, lambda r: [(-1.0, 40), (-2.0, 41), (-3.0, 42), (-4.0, 43)])
    assert group.done and [t for _, _, t in group.finished] == [[10, 2], [11, 30, 40]]
    assert_released(sched)


# ---- the runner's batch flattening ----------------------------------------------------------------------------
class RecordingModel(torch.nn.Module):
    """hidden state = the input token id; logits one-hot at (token + 1) % vocab: greedy sampling answers
    token + 1 for the row's last input token."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.calls = []

    def forward(self, input_ids, positions, kv_caches, meta):
        self.calls.append((input_ids.tolist(), positions.tolist(), meta))
        return input_ids.float()[:, None]

    def compute_logits(self, hidden, out=None):
        logits = torch.full((hidden.shape[0], self.vocab), -1.0)
        logits[torch.arange(hidden.shape[0]), (hidden[:, 0].long() + 1) % self.vocab] = 1.0
        return logits


def test_runner_flattens_the_batch_and_maps_rows():
    from pagedllm.model.config import ModelConfig
    from pagedllm.worker.model_runner import ModelRunner

    cfg = ModelConfig(architecture="llama", num_layers=1, hidden_size=8, intermediate_size=8, num_heads=2,
                      num_kv_heads=1, head_dim=4, vocab_size=500, max_position_embeddings=64, rms_norm_eps=1e-5)
    model = RecordingModel(cfg.vocab_size)
    runner = ModelRunner(model, cfg, num_blocks=16, block_size=4, kv_dtype=torch.float32,
                         attention_backend="reference")
    rng = random.Random(5)
    prefill = Request("p", [rng.randrange(400) for _ in range(9)], sampling_params=GREEDY, num_computed_tokens=3)
    decode = Request("d", [7, 8], output_token_ids=[100], sampling_params=GREEDY, num_computed_tokens=2)
    forking = Request("f", [50, 51, 52], sampling_params=SamplingParams(temperature=0.0), fork_ids=["f#1"])
    chunk = Request("c", list(range(200, 220)), sampling_params=GREEDY)
    scheduled = [ScheduledRequest(prefill, 6, [], True, [[0, 1, 2]]),
                 ScheduledRequest(decode, 3, [101, 102], True, [[3, 7]]),  # its last token + 2 drafts
                 ScheduledRequest(forking, 3, [], True, [[4]]),
                 ScheduledRequest(chunk, 5, [], False, [[5, 6]])]  # a prefill chunk: no logits
    out = runner.execute(scheduled, [])
    ids, positions, meta = model.calls[-1]
    assert ids == prefill.all_token_ids[3:9] + [100, 101, 102] + [50, 51, 52] + chunk.all_token_ids[:5]
    assert positions == [3, 4, 5, 6, 7, 8] + [2, 3, 4] + [0, 1, 2] + [0, 1, 2, 3, 4]
    assert meta.block_tables[1].tolist()[:2] == [3, 7] and meta.seq_lens.tolist() == [9, 5, 3, 5]
    # rows: prefill's last token; decode's last token and each draft prefix; the fork's one row twice
    last = prefill.all_token_ids[8]
    assert out.sampled.token_ids == [last + 1, 101, 102, 103, 53, 53]
