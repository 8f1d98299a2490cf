"""POST /v1/embeddings, as OpenAI's (and vLLM's `truncate_prompt_tokens`): the pooling runner's embeddings of one
or several inputs, as float lists or base64 of little-endian float32."""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import OpenAIModel
from pagedllm.entrypoints.openai.serving import OpenAIServing, Prompt, now, random_id
from pagedllm.entrypoints.openai.validation import check_unicode
from pagedllm.outputs import EmbeddingRequestOutput
from pagedllm.pooling_params import PoolingParams


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    # a text, texts, one prompt's token ids, or several prompts' (OpenAI's four forms)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = None  # keep the last N tokens (-1: as many as the context holds)
    normalize: bool | None = None
    request_id: str | None = None
    priority: int = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode_embedding(values: list[float], encoding_format: str) -> list[float] | str:
    """base64 as OpenAI's: the little-endian float32 bytes (numpy.frombuffer(..., "<f4") reads them back)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return values


def input_prompts(value: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise OpenAIError(400, "input must not be empty", param="input", code="invalid_value")
    if all(isinstance(x, int) for x in value):
        return [list(value)]  # one prompt's token ids
    return list(value)


class OpenAIServingEmbedding(OpenAIServing):
    id_prefix = "embd"
    request_params = set(EmbeddingRequest.model_fields)

    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:  # type: ignore[override]
        check_unicode(req)
        self.warn_unknown_fields(req)
        lora = self.check_model(req.model)
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize,
                               truncate_prompt_tokens=req.truncate_prompt_tokens)
        try:
            params.validate()
        except ValueError as e:
            raise bad_request(e, self.request_params) from e
        prompts = input_prompts(req.input)
        request_id = req.request_id or random_id(self.id_prefix)
        streams = await self.submit(prompts, params, request_id, None, self.request_params, req.priority,
                                    param="input", lora_request=lora)
        finals = await self.finish(raw, streams)
        if isinstance(finals, Response):
            return finals
        return JSONResponse(self.response_of(req, request_id, finals).model_dump(mode="json"))

    def response_of(self, req: EmbeddingRequest, request_id: str,
                    finals: list[EmbeddingRequestOutput]) -> EmbeddingResponse:
        data = [EmbeddingData(index=i, embedding=encode_embedding(out.outputs.embedding, req.encoding_format))
                for i, out in enumerate(finals)]
        tokens = sum(len(out.prompt_token_ids) for out in finals)
        return EmbeddingResponse(id=request_id, created=now(), model=req.model or self.served_model_name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def add_embedding_routes(app: FastAPI, embedding: OpenAIServingEmbedding) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
        return await embedding.create(req, raw)
