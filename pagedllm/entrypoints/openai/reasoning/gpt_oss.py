"""gpt-oss (harmony): the analysis channel is the reasoning, what follows it is the content. Final-channel and
commentary messages become their text; calls (`to=functions.NAME`) stay harmony text for the gpt_oss tool
parser to read."""

from __future__ import annotations

from pagedllm.entrypoints.openai import harmony
from pagedllm.entrypoints.openai.reasoning.base import ReasoningParser, Split, Start


class GptOssReasoningParser(ReasoningParser):
    name = "gpt_oss"
    keeps_special_tokens = True  # the channels are marked by special tokens
    start = harmony.CHANNEL + "analysis" + harmony.MESSAGE
    # no single token ends the reasoning (<|message|> also opens the final answer), so a constrained output gets
    # no reasoning gate: its constraint holds from the first token (output_plan._gate)
    end = harmony.END + harmony.START

    def start_state(self, prompt: str) -> Start:
        return Start.OPEN  # the template ends the prompt with `<|start|>assistant`: the output opens a header

    def split(self, text: str, start: Start, final: bool) -> Split:
        """Reasoning: the analysis messages before any other message (one line each). A later analysis message
        (rare: the reasoning is sent first) stays in the content as text."""
        if start is Start.OFF:
            return Split("", text, True)
        reasoning: list[str] = []
        rest: list[harmony.Item] = []
        for item in harmony.read(text, final):
            if not rest and isinstance(item, harmony.Message) and item.reasoning:
                reasoning.append(item.body)
            elif rest or not isinstance(item, str) or item.strip():
                rest.append(item)
        content = "".join(p if isinstance(p, str) else harmony.render_call(p)
                          for p in harmony.flatten(rest, final, harmony.is_call))
        return Split("\n".join(reasoning), content, bool(rest) or final)
