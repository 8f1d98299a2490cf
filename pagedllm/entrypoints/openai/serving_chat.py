"""/v1/chat/completions: the model's chat template, then the same engine path as completions."""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.entrypoints.openai.errors import OpenAIError
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
)
from pagedllm.entrypoints.openai.serving import Call, LogprobFormatter, OpenAIServing, Prompt, usage_of
from pagedllm.entrypoints.openai.streams import ChoiceDelta
from pagedllm.outputs import CompletionOutput, RequestOutput


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

    def prompts(self, req: ChatCompletionRequest) -> list[Prompt]:
        try:
            messages = [m.to_template_dict() for m in req.messages]
            return [self.engine.apply_chat_template(messages)]
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages", code="invalid_value") from e
        except Exception as e:  # jinja errors of the template (roles must alternate, ...)
            raise OpenAIError(400, f"messages: chat template failed: {e}", param="messages",
                              code="invalid_value") from e

    def response(self, call: Call, finals: list[RequestOutput]) -> ChatCompletionResponse:
        (final,) = finals
        choices = [
            ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                 logprobs=_logprobs(call.fmt, c, 0, len(c.token_ids)) if call.req.logprobs else None,
                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for c in sorted(final.outputs, key=lambda c: c.index)
        ]
        return ChatCompletionResponse(id=call.request_id, created=call.created, model=call.model, choices=choices,
                                      usage=usage_of(finals))

    def stream_start(self, call: Call) -> Iterable[ChatCompletionStreamResponse]:
        for i in range(call.params.n):
            yield self.stream_chunk(call, ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))

    def stream_delta(self, call: Call, index: int, c: CompletionOutput, d: ChoiceDelta
                     ) -> Iterable[ChatCompletionStreamResponse]:
        lp = None
        if call.req.logprobs and d.end_token > d.start_token:
            lp = _logprobs(call.fmt, c, d.start_token, d.end_token)
        if d.text or lp is not None:
            yield self.stream_chunk(call, ChatStreamChoice(index=index, delta=DeltaMessage(content=d.text), logprobs=lp))
        if d.finish_reason is not None:
            yield self.stream_chunk(call, ChatStreamChoice(index=index, delta=DeltaMessage(),
                                                     finish_reason=d.finish_reason, stop_reason=c.stop_reason))
