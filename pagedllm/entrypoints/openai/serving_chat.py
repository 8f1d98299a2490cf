"""/v1/chat/completions: the model's chat template, then the same engine path as completions."""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
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
    ToolCall,
)
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
    plan_tools,
    requested_structure,
    template_supports_tools,
    tool_calls_of,
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

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan | None:
        return plan_tools(req.tools, req.tool_choice, template_supports_tools(self.engine.tokenizer),
                          self.engine.model_name)

    def structure(self, req: ChatCompletionRequest) -> StructuredOutputsParams | None:
        plan, asked = self.tool_plan(req), requested_structure(req)
        if plan is not None and plan.structure is not None and asked is not None:
            raise ValueError(f"{asked.field_name}: cannot be combined with a forced tool_choice")
        return plan.structure if plan is not None and plan.structure is not None else asked

    async def prompts(self, req: ChatCompletionRequest) -> list[Prompt]:
        template = self.request_chat_template(req.chat_template)
        try:
            messages = [m.to_template_dict() for m in req.messages]
            options = req.template_options(template)
            if req.tools and template_supports_tools(self.engine.tokenizer):
                options["tools"] = req.tools
            return [await self.preprocess.render_chat(messages, **options)]
        except ValueError as e:
            raise bad_request(e, self.request_params) from e
        except Exception as e:  # jinja errors of the template (roles must alternate, ...)
            raise OpenAIError(400, f"messages: chat template failed: {e}", param="messages",
                              code="invalid_value") from e

    def _message(self, call: Call, c: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
        """The finished message of a choice and its finish reason (tool calls read back from the text)."""
        plan = self.tool_plan(call.req)
        if plan is None or c.finish_reason != "stop":
            return ChatResponseMessage(content=c.text), c.finish_reason
        calls, content = tool_calls_of(plan, c.text)
        if not calls:
            return ChatResponseMessage(content=c.text), c.finish_reason
        return ChatResponseMessage(content=content, tool_calls=[ToolCall(**t) for t in calls]), "tool_calls"

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
        if call.req.tools and self.tool_plan(call.req) is not None:
            yield from self._tool_stream_delta(call, index, c, d)
            return
        lp = None
        if call.req.logprobs and d.end_token > d.start_token:
            lp = _logprobs(call.fmt, c, d.start_token, d.end_token)
        if d.text or lp is not None:
            yield self.stream_chunk(call, ChatStreamChoice(index=index, delta=DeltaMessage(content=d.text), logprobs=lp))
        if d.finish_reason is not None:
            yield self.stream_chunk(call, ChatStreamChoice(index=index, delta=DeltaMessage(),
                                                     finish_reason=d.finish_reason, stop_reason=c.stop_reason))

    def _tool_stream_delta(self, call: Call, index: int, c: CompletionOutput, d: ChoiceDelta
                           ) -> Iterable[ChatCompletionStreamResponse]:
        """With tools the text is read back whole: one delta with the message at the end of the choice."""
        if d.finish_reason is None:
            return
        message, finish_reason = self._message(call, c)
        calls = [dict(t.model_dump(), index=i) for i, t in enumerate(message.tool_calls or [])]
        lp = _logprobs(call.fmt, c, 0, len(c.token_ids)) if call.req.logprobs else None
        yield self.stream_chunk(call, ChatStreamChoice(
            index=index, delta=DeltaMessage(content=message.content, tool_calls=calls or None), logprobs=lp))
        yield self.stream_chunk(call, ChatStreamChoice(index=index, delta=DeltaMessage(),
                                                       finish_reason=finish_reason, stop_reason=c.stop_reason))
