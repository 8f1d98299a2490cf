"""/v1/chat/completions: the model's chat template, then the same engine path as completions."""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.output_parser import Segment, SegmentEvent, mark_cut, parse_final
from pagedllm.entrypoints.openai.output_plan import plan_output
from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobToken,
    ChatLogprobTop,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    FunctionCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.reasoning import ReasoningParser
from pagedllm.entrypoints.openai.serving import (
    Call,
    LogprobFormatter,
    OpenAIServing,
    Prompt,
    prompt_logprobs_json,
    usage_of,
)
from pagedllm.entrypoints.openai.streams import ChoiceDelta
from pagedllm.entrypoints.openai.structured import (
    ToolPlan,
    auto_tool_parser,
    plan_tools,
    requested_structure,
    template_supports_tools,
)
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.structured import StructuredOutputsParams


def _logprobs(fmt: LogprobFormatter, c: CompletionOutput, start: int, end: int) -> ChatChoiceLogprobs:
    content = [
        ChatLogprobToken(token=t, logprob=lp, bytes=list(t.encode("utf-8")),
                         top_logprobs=[ChatLogprobTop(token=tt, logprob=tl, bytes=list(tt.encode("utf-8")))
                                       for tt, tl in top])
        for t, lp, top in fmt.entries(c, start, end)
    ]
    return ChatChoiceLogprobs(content=content)


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"
    stream_model = ChatCompletionStreamResponse
    request_params = set(ChatCompletionRequest.model_fields)
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    tool_call_parser: str | None = None  # --tool-call-parser (default: the chat template's format)

    def template(self, req: ChatCompletionRequest) -> str | None:
        return req.chat_template or self.default_chat_template or getattr(self.engine.tokenizer, "chat_template", None)

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan | None:
        return plan_tools(req.tools, req.tool_choice, auto_tool_parser(self.tool_call_parser, self.template(req)),
                          self.engine.model_name, req.parallel_tool_calls)

    def structure(self, call: Call) -> StructuredOutputsParams | None:
        req = call.req
        plan, asked = self.tool_plan(req), requested_structure(req)
        if plan is not None and plan.structure is not None and asked is not None:
            raise ValueError(f"{asked.field_name}: cannot be combined with a forced tool_choice")
        structure = plan.structure if plan is not None and plan.structure is not None else asked
        call.parser = plan_output(self.engine.tokenizer, self.reasoning_parser, call.prompts[0], plan, structure)
        if call.parser.keeps_special_tokens:
            call.params.skip_special_tokens = False  # the parsers read markers that are special tokens
        return structure

    async def prompts(self, req: ChatCompletionRequest) -> list[Prompt]:
        template = self.request_chat_template(req.chat_template)
        try:
            messages = [m.to_template_dict() for m in req.messages]
            options = req.template_options(template)
            if req.tools and template_supports_tools(self.template(req)):
                options["tools"] = req.tools
            return [await self.preprocess.render_chat(messages, **options)]
        except ValueError as e:
            raise bad_request(e, self.request_params) from e
        except Exception as e:  # jinja errors of the template (roles must alternate, ...)
            raise OpenAIError(400, f"messages: chat template failed: {e}", param="messages",
                              code="invalid_value") from e

    def _message(self, call: Call, c: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
        """The finished message of a choice and its finish reason (reasoning and tool calls read from the text)."""
        if call.parser is None or call.parser.plain:
            return ChatResponseMessage(content=c.text), c.finish_reason
        segments = parse_final(call.parser, c.text)
        mark_cut(segments, c.finish_reason)
        reasoning = "".join(s.text for s in segments if s.kind == "reasoning") or None
        texts = [s.text for s in segments if s.kind == "text"]
        calls = [ToolCall(id=s.call_id, function=FunctionCall(name=s.name, arguments=s.text))
                 for s in segments if s.kind == "call"]
        content = "".join(texts) if texts else (None if calls or reasoning else "")
        message = ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)
        return message, finish_reason_of(calls, c.finish_reason)

    def response(self, call: Call, finals: list[RequestOutput]) -> ChatCompletionResponse:
        (final,) = finals
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            message, finish_reason = self._message(call, c)
            choices.append(ChatCompletionChoice(
                index=c.index, message=message, finish_reason=finish_reason, stop_reason=c.stop_reason,
                logprobs=_logprobs(call.fmt, c, 0, len(c.token_ids)) if call.req.logprobs else None))
        return ChatCompletionResponse(id=call.request_id, created=call.created, model=call.model, choices=choices,
                                      usage=usage_of(finals), prompt_logprobs=prompt_logprobs_json(final))

    def stream_start(self, call: Call) -> Iterable[ChatCompletionStreamResponse]:
        for i in range(call.params.n):
            yield self.stream_chunk(call, ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))

    def stream_delta(self, call: Call, index: int, c: CompletionOutput, d: ChoiceDelta
                     ) -> Iterable[ChatCompletionStreamResponse]:
        lp = None
        if call.req.logprobs and d.end_token > d.start_token:
            lp = _logprobs(call.fmt, c, d.start_token, d.end_token)
        if call.parser is None or call.parser.plain:
            deltas = [DeltaMessage(content=d.text)] if d.text else []
        else:
            events = [ev for ev in call.segment_events(index, d)  # chat has no start / end of text
                      if ev.type == "delta" or (ev.type == "start" and ev.segment.kind == "call")]
            deltas = [_delta_of(call.segment_streams[index].segments, ev) for ev in events]
        if lp is not None and not deltas:
            deltas = [DeltaMessage()]
        for k, delta in enumerate(deltas):
            yield self.stream_chunk(call, ChatStreamChoice(index=index, delta=delta, logprobs=lp if k == 0 else None))
        if d.finish_reason is not None:
            stream = call.segment_streams.get(index)
            calls = [s for s in stream.segments if s.kind == "call"] if stream is not None else []
            yield self.stream_chunk(call, ChatStreamChoice(index=index, delta=DeltaMessage(),
                                                           finish_reason=finish_reason_of(calls, d.finish_reason),
                                                           stop_reason=c.stop_reason))


def finish_reason_of(calls: list, finish_reason: str | None) -> str | None:
    """A choice that stopped after writing calls asks for them; one cut by max_tokens says so."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _delta_of(segments: list[Segment], ev: SegmentEvent) -> DeltaMessage:
    seg = ev.segment
    if seg.kind == "reasoning":
        return DeltaMessage(reasoning_content=ev.delta)
    if seg.kind == "text":
        return DeltaMessage(content=ev.delta)
    index = sum(1 for s in segments[:ev.index] if s.kind == "call")  # the call's index among the calls
    if ev.type == "start":
        return DeltaMessage(tool_calls=[{"index": index, "id": seg.call_id, "type": "function",
                                         "function": {"name": seg.name, "arguments": ""}}])
    return DeltaMessage(tool_calls=[{"index": index, "function": {"arguments": ev.delta}}])
