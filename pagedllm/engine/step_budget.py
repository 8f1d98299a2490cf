"""How many prompt tokens a step may take, for a target step time, from what recent steps cost on this machine.

A GPU engine's fixed token budget (vLLM's 2048) makes a CPU step several seconds long: every running request waits
that long for its next token, and the first tokens of the prompts in the step all come at its end. Here the
engine learns a step's cost online, by weighted least squares over recent steps (exponentially forgotten):
- a decode-only step costs a + b x rows;
- prompt tokens add to a step, beyond its decode part, a fixed cost plus one per token. The fixed part is what a
  mixture of experts pays for having prompt tokens at all: they pick experts the decode rows did not, and each of
  those experts' weights is read whole however few tokens use it (a dense model's is about 0).
Each step then takes the prompt tokens that fit the target: with requests decoding, 1.75 decode-only steps of all
the streams (decoding or waiting on their prompts), so that the inter-token latency stays under twice a decode step
while prompts are computed, with room for the noise of real steps (at least `min_target_s`); with none decoding,
`idle_target_s`. A step never takes so few prompt tokens that the fixed part exceeds their own cost.
Sized instead from the average cost per prompt token and from the rows decoding now, the budget fed on itself: a
small chunk looked dear, fewer streams decoded while the rest waited on their prompts, so the decode step and with
it the target shrank, and chunks fell to `min_tokens` with half the streams waiting (BENCHMARKS.md, Mixtures of
experts).
`max_step_ms` sets the whole step's target instead; "off" keeps the fixed max_num_batched_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.95  # weight of the past per new observation (about the last 20 steps count)


@dataclass
class _LinearFit:
    """Weighted least squares of seconds on a count (rows, tokens), with exponential forgetting."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n, self.sx, self.sy = _DECAY * self.n + 1, _DECAY * self.sx + x, _DECAY * self.sy + y
        self.sxx, self.sxy = _DECAY * self.sxx + x * x, _DECAY * self.sxy + x * y

    def line(self) -> tuple[float, float, float | None] | None:
        """(mean x, mean y, slope): the slope None where the x seen so far have (almost) no spread."""
        if self.n < 1:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx**2
        return mx, my, ((self.sxy / self.n - mx * my) / var if var > 1e-6 * max(mx * mx, 1.0) else None)

    def predict(self, x: float) -> float | None:
        if (fit := self.line()) is None:
            return None
        mx, my, slope = fit
        return max(0.0, my + max(0.0, slope or 0.0) * (x - mx))


class StepBudget:
    def __init__(self, max_step_ms: float | str, max_tokens: int, *, idle_target_s: float = 0.5,
                 min_target_s: float = 0.05, first_budget: int = 256, min_tokens: int = 16) -> None:
        """max_step_ms: "auto", "off" or a number of milliseconds; max_tokens: the hard cap per step."""
        self.off = max_step_ms == "off"
        self.target_s = None if max_step_ms in ("auto", "off") else float(max_step_ms) / 1e3
        self.max_tokens = max_tokens
        self.idle_target_s = idle_target_s
        self.min_target_s = min_target_s  # (a step also pays a fixed cost: scheduling, reading the weights)
        self.first_budget = min(first_budget, max_tokens)
        self.min_tokens = min(min_tokens, max_tokens)
        self.decode = _LinearFit()
        self.prompt = _LinearFit()  # seconds beyond the step's decode part, on its prompt tokens

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """A step that computed `prompt_tokens` prompt tokens and `decode_rows` decode tokens took `seconds`."""
        if prompt_tokens == 0:
            if decode_rows:
                self.decode.add(decode_rows, seconds)
            return
        base = (self.decode.predict(decode_rows) or 0.0) if decode_rows else 0.0
        self.prompt.add(prompt_tokens, max(seconds - base, 0.0))

    def prompt_cost(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) that prompt tokens add to a step; the fixed part 0 (the cost
        proportional) until the chunk sizes seen spread enough to tell the two apart."""
        if (fit := self.prompt.line()) is None or fit[1] <= 0:
            return None
        mx, my, slope = fit
        if slope is None or slope <= 0 or my - slope * mx < 0:
            return 0.0, my / mx
        return my - slope * mx, slope

    def prompt_budget(self, decode_rows: int, streams: int = 0) -> int | None:
        """Prompt tokens the next step may take (None: no limit beyond max_num_batched_tokens), with `decode_rows`
        decoding among `streams` requests in all (those waiting on their prompts included)."""
        if self.off:
            return None
        if (cost := self.prompt_cost()) is None:
            return self.first_budget  # nothing measured yet
        fixed, per_token = cost
        decode_s = (self.decode.predict(decode_rows) or 0.0) if decode_rows else 0.0
        if self.target_s is not None:  # the whole step within the target
            room = self.target_s - decode_s - fixed
        elif decode_rows and decode_s > 0:
            every = self.decode.predict(max(decode_rows, streams)) or decode_s  # a step with every stream decoding
            room = max(1.75 * every, self.min_target_s) - decode_s - fixed
        else:
            room = self.idle_target_s - fixed
        tokens = int(max(room, fixed) / per_token)
        return max(self.min_tokens, min(self.max_tokens, tokens))
