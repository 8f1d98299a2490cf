"""vLLM's extra endpoints: /tokenize, /detokenize, /version, POST /reset_prefix_cache."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import VERSION, ChatMessage, OpenAIModel
from pagedllm.entrypoints.openai.serving import OpenAIServing


class TokenizeRequest(OpenAIModel):
    """Either a prompt, or chat messages rendered with the chat template first (vLLM's two forms)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has them)
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class OpenAIServingTokens(OpenAIServing):
    """Tokenization as the engine does it (a chat template's own BOS is not doubled), off the event loop."""

    request_params = set(TokenizeRequest.model_fields) | set(DetokenizeRequest.model_fields)

    def _tokenize(self, req: TokenizeRequest) -> list[int]:
        tok = self.engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        if req.messages is not None:
            messages = [m.to_template_dict() for m in req.messages]
            text = self.engine.apply_chat_template(
                messages, chat_template=self.request_chat_template(req.chat_template),
                chat_template_kwargs=req.chat_template_kwargs, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message)
            return tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        if req.add_special_tokens is False:
            return tok.encode(req.prompt, add_special_tokens=False)
        if not req.prompt:
            return []
        local = getattr(self.engine, "engine", None)  # the engine's own rule (no doubled BOS) where it is local
        return local.tokenize(req.prompt) if local is not None else tok.encode(req.prompt)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.warn_unknown_fields(req)
        self.check_model(req.model)
        self.request_chat_template(req.chat_template)  # a 400 before any work
        try:
            ids = await self.preprocess.run(self._tokenize, req)
        except ValueError as e:
            raise bad_request(e, self.request_params) from e
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids,
                                token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.warn_unknown_fields(req)
        self.check_model(req.model)
        vocab = len(self.engine.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"tokens outside the vocabulary (size {vocab}): {bad[:5]}", param="tokens",
                              code="invalid_value")
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.engine.tokenizer.decode, req.tokens))


def add_extra_routes(app: FastAPI, tokens: OpenAIServingTokens) -> None:
    engine = tokens.engine

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return await tokens.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return await tokens.detokenize(req)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_external: bool = False) -> dict[str, bool]:
        """Forget every cached prefix block; refused (409) while requests hold blocks. ?reset_external=true (vLLM's
        name) also deletes the disk tier's entries (--kv-disk-cache-dir)."""
        if not await engine.reset_prefix_cache(reset_external):
            raise OpenAIError(409, "cannot reset the prefix cache while requests hold KV blocks",
                              code="engine_busy")
        return {"reset": True}
