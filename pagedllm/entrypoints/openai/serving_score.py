"""POST /v1/score and /v1/rerank (also /rerank and /v2/rerank), in vLLM's shapes (rerank: Jina's and Cohere's). A
cross-encoder scores each (query, document) pair tokenized together; an embedding model scores the cosine of the
two texts' embeddings, as vLLM does. Both need the pooling runner."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from pagedllm.engine.scoring import cosine, pair_up, score_task, tokenize_pair
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import OpenAIModel, UsageInfo
from pagedllm.entrypoints.openai.serving import OpenAIServing, now, random_id
from pagedllm.entrypoints.openai.validation import check_unicode
from pagedllm.pooling_params import PoolingParams


class ScoreRequest(OpenAIModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None
    priority: int = 0


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    text: str


class RerankRequest(OpenAIModel):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]  # Cohere's strings, or Jina's {"text": ...}
    top_n: int | None = None  # None or 0: all of them, best first
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None
    priority: int = 0


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class OpenAIServingScore(OpenAIServing):
    id_prefix = "score"
    request_params = set(ScoreRequest.model_fields) | set(RerankRequest.model_fields)

    def check_runner(self) -> None:
        runner = getattr(self.engine, "runner_name", "pooling")
        if runner != "pooling":
            raise OpenAIError(400, f"this server runs the {runner!r} runner, which does not score: scores and "
                                   f"reranking need an embedding or cross-encoder model served with `--runner "
                                   f"pooling`", code="invalid_request")

    async def scores(self, raw: Request, pairs: list[tuple[str, str]], truncate: int | None, request_id: str,
                     priority: int, param: str) -> tuple[list[float], int] | Response:
        """Each pair's score and the prompt tokens read (a 499 response if the client left)."""
        params = PoolingParams(truncate_prompt_tokens=truncate)
        try:
            params.validate()
        except ValueError as e:
            raise bad_request(e, self.request_params) from e
        if score_task(self.engine) == "score":
            prompts: list = []
            for i, (a, b) in enumerate(pairs):
                try:
                    prompts.append(await self.preprocess.run(tokenize_pair, self.engine.tokenizer, a, b,
                                                             self.engine.max_model_len, truncate))
                except ValueError as e:
                    raise OpenAIError(400, f"{param}[{i}]: {e}", param=param, code="invalid_value") from e
        else:  # an embedding model: each distinct text embedded once
            prompts = list(dict.fromkeys(t for pair in pairs for t in pair))
        streams = await self.submit(prompts, params, request_id, None, self.request_params, priority, param=param)
        finals = await self.finish(raw, streams)
        if isinstance(finals, Response):
            return finals
        tokens = sum(len(o.prompt_token_ids) for o in finals)
        if score_task(self.engine) == "score":
            return [o.outputs.embedding[0] for o in finals], tokens
        vectors = {text: o.outputs.embedding for text, o in zip(prompts, finals, strict=True)}
        return [cosine(vectors[a], vectors[b]) for a, b in pairs], tokens

    def _start(self, req: ScoreRequest | RerankRequest) -> str:
        check_unicode(req)
        self.warn_unknown_fields(req)
        self.check_model(req.model)
        self.check_runner()
        return req.request_id or random_id(self.id_prefix)

    async def score(self, req: ScoreRequest, raw: Request) -> Response:
        request_id = self._start(req)
        try:
            pairs = pair_up(req.text_1, req.text_2)
        except (TypeError, ValueError) as e:
            raise OpenAIError(400, str(e), param="text_1", code="invalid_value") from e
        done = await self.scores(raw, pairs, req.truncate_prompt_tokens, request_id, req.priority, "text_2")
        if isinstance(done, Response):
            return done
        scores, tokens = done
        body = ScoreResponse(id=request_id, created=now(), model=req.model or self.served_model_name,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))
        return JSONResponse(body.model_dump(mode="json"))

    async def rerank(self, req: RerankRequest, raw: Request) -> Response:
        request_id = self._start(req)
        if not req.documents:
            raise OpenAIError(400, "documents must not be empty", param="documents", code="invalid_value")
        if req.top_n is not None and req.top_n < 0:
            raise OpenAIError(400, f"top_n must be >= 0, got {req.top_n}", param="top_n", code="invalid_value")
        if not req.query:
            raise OpenAIError(400, "query must not be empty", param="query", code="invalid_value")
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        done = await self.scores(raw, [(req.query, d) for d in docs], req.truncate_prompt_tokens, request_id,
                                 req.priority, "documents")
        if isinstance(done, Response):
            return done
        scores, tokens = done
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n or None]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=docs[i]) if req.return_documents else None)
                   for i in order]
        body = RerankResponse(id=request_id, model=req.model or self.served_model_name,
                              usage=RerankUsage(total_tokens=tokens), results=results)
        return JSONResponse(body.model_dump(mode="json", exclude_none=True))


def add_score_routes(app: FastAPI, serving: OpenAIServingScore) -> None:
    @app.post("/v1/score")
    @app.post("/score")
    async def score(req: ScoreRequest, raw: Request) -> Response:
        return await serving.score(req, raw)

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(req: RerankRequest, raw: Request) -> Response:
        return await serving.rerank(req, raw)
