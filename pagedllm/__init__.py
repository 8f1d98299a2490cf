"""pagedllm: a small LLM inference and serving engine built around PagedAttention."""

import os

# OpenMP workers sleep after every parallel region unless they spin a while first; waking them costs tens of
# microseconds on a VM and a decode step has ~150 regions. Spinning a short while (~0.1 ms) measured on 2 idle cores:
# single-stream decode 84 tok/s vs 48 with OMP_WAIT_POLICY=PASSIVE, a 64-request step 65 ms vs 152. On a machine shared
# with other busy processes spinning loses (27 vs 60 tok/s): set OMP_WAIT_POLICY=PASSIVE there. Must be set before
# torch loads; a value the user set wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "5000")

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
