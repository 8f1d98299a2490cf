"""Pydantic models of the OpenAI API subset we serve (requests validated, responses serialised)."""

from __future__ import annotations

import importlib.metadata
import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedllm.sampling_params import SamplingParams

try:
    VERSION = importlib.metadata.version("pagedllm")
except importlib.metadata.PackageNotFoundError:  # run from a source tree
    VERSION = "0+unknown"
SYSTEM_FINGERPRINT = f"pagedllm-{VERSION}"
MAX_N = 128  # as OpenAI: each sample holds its own blocks once it diverges


class OpenAIModel(BaseModel):
    # Unknown request fields are accepted and ignored (the server logs their names once), as vLLM does:
    # clients such as LangChain and newer SDKs send fields we do not know.
    model_config = ConfigDict(extra="allow")


# --- errors and models ---------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None  # what it was loaded from (an adapter: its path), as vLLM's
    parent: str | None = None  # a LoRA adapter's base model id
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str | None = None
    lora_int_id: int | None = None


# --- shared pieces -------------------------------------------------------------------------------------------
class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage so far in every chunk


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}


class _SamplingFields(OpenAIModel):
    """Fields shared by both endpoints; OpenAI's and the vLLM-style extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # extras (vLLM names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    # structured outputs (structured.py reads them): OpenAI's response_format, vLLM's extras
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    request_id: str | None = None  # the response id (vLLM); random when not given
    priority: int = 0  # lower first under --scheduling-policy priority; ignored under fcfs (the default)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Fields the request leaves out take the model's defaults (--generation-config), then vLLM's.
        Raises ValueError naming the parameter when a value is out of range."""
        d = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
             **(defaults or {})}

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return d[name] if value is None else value

        if isinstance(self.n, int) and self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        return SamplingParams(
            n=self.n,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            max_tokens=d.get("max_tokens") if max_tokens is None else max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty"),
            skip_special_tokens=self.skip_special_tokens,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


# --- /v1/completions -----------------------------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("logprobs is not supported together with echo")
        return self._sampling_params(self.max_tokens, self.logprobs, defaults)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


PromptLogprobs = list[dict[str, dict[str, Any]] | None]  # vLLM's: per prompt token {token id: {logprob, ...}}


class _Choice(BaseModel):
    """What every choice of a response or a stream chunk carries besides its text or message."""
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it (vLLM)


class _Response(BaseModel):
    """The head of every completion response and stream chunk."""
    id: str
    created: int
    model: str
    system_fingerprint: str | None = SYSTEM_FINGERPRINT


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(CompletionResponse):
    usage: UsageInfo | None = None


# --- /v1/chat/completions ------------------------------------------------------------------------------------
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... are passed to the template as they are
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise ValueError("messages: only text content parts are supported")
            content = "".join(p.text or "" for p in content)
        d = self.model_dump(exclude_none=True)
        d["role"] = "system" if self.role == "developer" else self.role
        d["content"] = content or ""
        for call in d.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                fn["arguments"] = arguments_object(fn.get("arguments"))
        return d


def parts_text(content: Any, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """The text of a content field of another API: a string, or a list of text parts of `kinds` (their "text",
    or a refusal's "refusal"); ValueError naming the part otherwise."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text", part.get("refusal")) if kind in kinds else None
        if not isinstance(text, str):
            raise ValueError(f"{where}[{j}]: only text parts are supported here (got {kind!r})")
        out.append(text)
    return "".join(out)


def arguments_object(arguments: Any) -> Any:
    """Tool-call arguments as the object chat templates render with `tojson` (transformers' convention; the
    OpenAI wire format sends JSON text): text that is not a JSON object stays as it is."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # accepted and ignored: hints and bookkeeping that do not change what is generated
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None
    # the template variable gpt-oss's template reads for its system message (`Reasoning: high`)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # chat template controls (vLLM names)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def template_options(self, template: str | None = None) -> dict[str, Any]:
        """Rendering options; `template`: the one to render with (the request's own only if trusted). The
        request's chat_template_kwargs win over reasoning_effort."""
        kwargs = self.chat_template_kwargs
        if self.reasoning_effort is not None:
            kwargs = {"reasoning_effort": self.reasoning_effort, **(kwargs or {})}
        return {"chat_template": template,
                "chat_template_kwargs": kwargs,
                "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.functions or self.function_call:
            raise ValueError("functions is not supported (use tools)")
        if self.modalities and set(self.modalities) != {"text"}:
            raise ValueError("modalities: only 'text' is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults)


def chat_request(names: dict[str, str], **fields: Any) -> ChatCompletionRequest:
    """The chat request another API's request runs as; a field that does not validate is a ValueError naming
    the other API's field (`names`: chat field -> its name there)."""
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        field = names.get(loc[0], loc[0]) if loc else "body"
        raise ValueError(f"{field}: {'.'.join(loc[1:]) + ': ' if loc[1:] else ''}{err.get('msg')}") from None


class ChatLogprobTop(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the model's reasoning (vLLM's name)
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(_Choice):
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's tool call deltas: {"index", "id", "type", "function"}


class ChatStreamChoice(_Choice):
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
