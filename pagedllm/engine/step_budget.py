"""How many prompt tokens a step may take, for a target step time, from what recent steps cost on this machine.

A GPU engine's fixed token budget (vLLM's 2048) makes a CPU step several seconds long: every running request waits
that long for its next token, and the first tokens of the prompts in the step all come at its end. Here the
engine learns a step's cost online: a decode-only step costs a + b x rows (least squares over recent decode-only
steps, exponentially forgotten), and a prompt token what a step with prompt tokens took beyond its decode part.
Each step then takes the prompt tokens that fit the target: with requests decoding, twice a decode-only step
(so their inter-token latency at most doubles while prompts are computed; at least `min_target_s`); with none,
`idle_target_s`.
`max_step_ms` sets the target instead; "off" keeps the fixed max_num_batched_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.95  # weight of the past per new observation (about the last 20 steps count)


@dataclass
class _DecodeFit:
    """Weighted least squares of seconds on rows, with exponential forgetting."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n, self.sx, self.sy = _DECAY * self.n + 1, _DECAY * self.sx + x, _DECAY * self.sy + y
        self.sxx, self.sxy = _DECAY * self.sxx + x * x, _DECAY * self.sxy + x * y

    def predict(self, x: float) -> float | None:
        if self.n < 1:
            return None
        var = self.sxx / self.n - (self.sx / self.n) ** 2
        slope = max(0.0, (self.sxy / self.n - self.sx * self.sy / self.n**2) / var) if var > 1e-9 else 0.0
        return max(0.0, self.sy / self.n + slope * (x - self.sx / self.n))


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
        self.decode = _DecodeFit()
        self.token_s: float | None = None  # seconds per prompt token, beyond the step's decode part

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """A step that computed `prompt_tokens` prompt tokens and `decode_rows` decode tokens took `seconds`."""
        if prompt_tokens == 0:
            if decode_rows:
                self.decode.add(decode_rows, seconds)
            return
        base = (self.decode.predict(decode_rows) or 0.0) if decode_rows else 0.0
        per = max(seconds - base, 0.0) / prompt_tokens
        self.token_s = per if self.token_s is None else _DECAY * self.token_s + (1 - _DECAY) * per

    def prompt_budget(self, decode_rows: int) -> int | None:
        """Prompt tokens the next step may take (None: no limit beyond max_num_batched_tokens)."""
        if self.off:
            return None
        if self.token_s is None or self.token_s <= 0:
            return self.first_budget  # nothing measured yet
        decode_s = (self.decode.predict(decode_rows) or 0.0) if decode_rows else 0.0
        target = self.target_s
        if target is None:
            target = max(2 * decode_s, self.min_target_s) if decode_rows and decode_s > 0 else self.idle_target_s
        tokens = int(max(target - decode_s, 0.0) / self.token_s)
        return max(self.min_tokens, min(self.max_tokens, tokens))
