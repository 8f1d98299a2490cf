"""One sample's walk through a ReasoningGate: which of its tokens the grammar sees, and which rows it masks.
While the sample reasons its tokens are free and its matcher waits; once the end tokens are out, every token
goes to the matcher, as for a request without reasoning."""

from __future__ import annotations

from enum import Enum

from pagedllm.structured.params import ReasoningGate


class GateState(Enum):
    MAY_OPEN = "may_open"  # first token: the grammar's tokens or the start token
    REASONING = "reasoning"  # free tokens until the end tokens
    CONSTRAINED = "constrained"  # every token goes to the grammar


class GateWalk:
    def __init__(self, gate: ReasoningGate) -> None:
        self.gate = gate
        if gate.open:
            self.state = GateState.REASONING
        else:
            self.state = GateState.MAY_OPEN if gate.start is not None else GateState.CONSTRAINED
        self._tail: list[int] = []  # the last len(end) reasoning tokens

    @property
    def masked(self) -> bool:
        """This sample's next row gets the grammar's mask (plus `extra_token` when set)."""
        return self.state is not GateState.REASONING

    @property
    def extra_token(self) -> int | None:
        """A token allowed besides the grammar's: the start token while the model may still open a span."""
        return self.gate.start if self.state is GateState.MAY_OPEN else None

    def route(self, token: int) -> tuple[bool, bool]:
        """Take one appended token: (it goes to the grammar, the gate changed state with it). A change ends a
        step's draft walk: the rows after it were masked (or not) for the old state."""
        if self.state is GateState.CONSTRAINED:
            return True, False
        if self.state is GateState.MAY_OPEN:
            if token == self.gate.start:
                self.state = GateState.REASONING
                return False, True
            self.state = GateState.CONSTRAINED
            return True, True
        self._tail = (self._tail + [token])[-len(self.gate.end):]
        if tuple(self._tail) == self.gate.end:
            self.state = GateState.CONSTRAINED
            return False, True
        return False, False


class GatedMatcher:
    """A sequence's grammar behind its reasoning gate, as the scheduler sees a grammar (core/request.Grammar):
    reasoning tokens pass without the matcher, every token after the reasoning goes to it. `masked` and
    `extra_token` tell the engine how to mask the next row; `mask_changed` that the last token moved the gate, so
    rows already sampled under the old mask (speculative drafts) are not taken."""

    def __init__(self, matcher, gate: ReasoningGate) -> None:
        self.matcher = matcher
        self.walk = GateWalk(gate)
        self.mask_changed = False

    def accept(self, token: int) -> bool:
        to_grammar, self.mask_changed = self.walk.route(token)
        return self.matcher.accept(token) if to_grammar else True

    def is_terminated(self) -> bool:
        return self.walk.state is GateState.CONSTRAINED and self.matcher.is_terminated()

    @property
    def masked(self) -> bool:
        return self.walk.masked

    @property
    def extra_token(self) -> int | None:
        return self.walk.extra_token
