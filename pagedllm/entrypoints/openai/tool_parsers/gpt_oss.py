"""gpt-oss (harmony): a call is an assistant message addressed to a function,
`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the
recipient may also come before the channel). Its body is the arguments; <|call|> is an end-of-sequence token,
so a call usually ends with the text and is complete unless max_tokens cut it. Other messages are text."""

from __future__ import annotations

from pagedllm.entrypoints.openai import harmony
from pagedllm.entrypoints.openai.tool_parsers.base import ParsedCall, Piece, ToolParser


class GptOssToolParser(ToolParser):
    name = "gpt_oss"
    keeps_special_tokens = True  # harmony's markers are special tokens

    def pieces(self, text: str, final: bool) -> list[Piece]:
        out: list[Piece] = []
        for p in harmony.flatten(harmony.read(text, final), final, harmony.is_call):
            if isinstance(p, str):
                out.append(p)
                continue
            done = p.closed or (final and p.header_done)
            out.append(ParsedCall(p.function or "", harmony.call_arguments(p, done), complete=done))
        return out
