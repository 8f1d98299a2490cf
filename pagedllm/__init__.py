"""pagedllm: a small LLM inference and serving engine built around PagedAttention."""

import os

# OpenMP threads that spin while waiting steal the core from the thread doing the work whenever anything
# else runs on the machine (measured on 2 cores: single-stream decode 14 tok/s spinning vs 36-45 passive).
# Must be set before torch loads; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # Lazy: importing the package must not pull in torch for core-only users and tests.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
