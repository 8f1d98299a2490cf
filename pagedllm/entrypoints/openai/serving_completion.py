"""/v1/completions."""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
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
from pagedllm.outputs import CompletionOutput, RequestOutput


def _logprobs(fmt: LogprobFormatter, c: CompletionOutput, start: int, end: int, offset: int
              ) -> tuple[CompletionLogprobs, int]:
    lp = CompletionLogprobs()
    for text, logprob, top in fmt.entries(c, start, end):
        lp.tokens.append(text)
        lp.token_logprobs.append(logprob)
        lp.top_logprobs.append(dict(top))
        lp.text_offset.append(offset)
        offset += len(text)
    return lp, offset


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"
    stream_model = CompletionStreamResponse
    request_params = set(CompletionRequest.model_fields)

    def prompts(self, req: CompletionRequest) -> list[Prompt]:
        p = req.prompt
        if isinstance(p, str):
            prompts: list[Prompt] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]  # type: ignore[list-item]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if not prompts:
            raise OpenAIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        for q in prompts:
            if isinstance(q, list):
                self.check_token_ids(q)
        return prompts

    def _echo(self, call: Call, prompt_index: int) -> str:
        if not call.req.echo:
            return ""
        prompt = call.prompts[prompt_index]
        return prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)

    def response(self, call: Call, finals: list[RequestOutput]) -> CompletionResponse:
        want_logprobs = call.req.logprobs is not None
        choices = []
        for i, out in enumerate(finals):
            prefix = self._echo(call, i)
            for c in out.outputs:
                lp = _logprobs(call.fmt, c, 0, len(c.token_ids), len(prefix))[0] if want_logprobs else None
                choices.append(CompletionChoice(index=call.choice_index(i, c), text=prefix + c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=prompt_logprobs_json(out)))
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(id=call.request_id, created=call.created, model=call.model, choices=choices,
                                  usage=usage_of(finals))

    def stream_start(self, call: Call) -> Iterable[CompletionStreamResponse]:
        if not call.req.echo:
            return
        for i in range(len(call.prompts)):
            text = self._echo(call, i)
            for j in range(call.params.n):
                call.text_offsets[i * call.params.n + j] = len(text)
                yield self.stream_chunk(call, CompletionChoice(index=i * call.params.n + j, text=text))

    def stream_delta(self, call: Call, index: int, c: CompletionOutput, d: ChoiceDelta
                     ) -> Iterable[CompletionStreamResponse]:
        lp = None
        if call.req.logprobs is not None and d.end_token > d.start_token:
            lp, call.text_offsets[index] = _logprobs(call.fmt, c, d.start_token, d.end_token,
                                                     call.text_offsets.get(index, 0))
        if d.text or lp is not None:
            yield self.stream_chunk(call, CompletionChoice(index=index, text=d.text, logprobs=lp))
        if d.finish_reason is not None:
            yield self.stream_chunk(call, CompletionChoice(index=index, text="", finish_reason=d.finish_reason,
                                                     stop_reason=c.stop_reason))
