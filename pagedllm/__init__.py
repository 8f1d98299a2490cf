"""pagedllm: a small LLM inference and serving engine built around PagedAttention."""

import os

# OpenMP workers sleep after every parallel region unless they spin a while first, and a decode step has ~150
# regions: waking a sleeping worker every time costs more than a short spin (~0.1 ms) when the engine has the cores
# to itself. On a machine shared with other busy processes spinning steals their time slices and loses: set
# OMP_WAIT_POLICY=PASSIVE there. `pagedllm bench engine` run with and without OMP_WAIT_POLICY=PASSIVE measures both
# (BENCHMARKS.md, engine). Must be set before torch loads; a value the user set wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "5000")

from pagedllm.engine.request_stream import RequestFailedError
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.structured import StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "RequestFailedError", "StructuredOutputsParams", "PoolingParams", "EmbeddingRequestOutput", "EmbeddingOutput",
           "LoRARequest"]


def __getattr__(name: str):
    # Lazy: importing the package must not pull in torch for core-only users and tests.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
