"""Three ways to run a bf16 decoder layer's dense pointwise parts (RMSNorm, RoPE, SiLU gate, residuals), end to end.

- "eager": the model's torch layers, op by op;
- "compiled": the same torch layers with the pointwise code replaced by torch.compile(dynamic=True) versions
  (inductor's C++ backend fuses each into one kernel; linears and paged attention stay the engine's kernels);
- "fused": the engine's default, one C++ call per layer (csrc/decoder_layer.cpp).
It measures single-stream decode, a 512-token prefill and a decode step with 64 running requests, the three
modes interleaved. This bench is the evidence for what the engine runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.model import base, layers, mlp
from pagedllm_bench.engine import pagedllm_speeds, python_share


def compiled_pointwise() -> dict:
    """Compiled versions of the pointwise code, as (owner, attribute) -> replacement."""

    @torch.compile(dynamic=True)
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    @torch.compile(dynamic=True)
    def silu_gate(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        return F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]

    def swiglu(self: mlp.GatedMLP, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        if self.glu is not mlp.swiglu:  # (GeGLU, gpt-oss's clamped SwiGLU: as the model computes them)
            return self.down(self.glu(gu[:, :self.intermediate], gu[:, self.intermediate:]))
        return self.down(silu_gate(gu, self.intermediate))

    return {(layers.RMSNorm, "forward"): lambda self, x: rms_norm(x, self.weight, self.eps),
            (mlp.GatedMLP, "forward"): swiglu,
            (base, "apply_rope"): torch.compile(layers.apply_rope, dynamic=True)}


def measure(llm: LLM, first_token: int) -> dict[str, float]:
    # prompts from first_token on: no measurement may hit another one's cached prefixes
    prefill, decode = pagedllm_speeds(llm, list(range(first_token, first_token + 512)), 1)
    step = python_share(llm, 64, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "step64_ms": step}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 repetition")


def run(args: argparse.Namespace) -> None:
    repeat = 1 if args.quick else args.repeat
    llm = LLM(dtype="bfloat16", kv_cache_memory="2GiB", quantization="none")
    compiled = compiled_pointwise()
    eager_code = {key: getattr(*key) for key in compiled}

    def use(code: dict) -> None:
        for (owner, name), fn in code.items():
            setattr(owner, name, fn)

    model = llm.engine.runner.model
    model.fused_layers = False
    use(compiled)
    t0 = time.perf_counter()
    llm.generate([list(range(100, 612))], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for n in (3, 64):  # decode batches of other sizes: dynamic shapes compile once more at most
        llm.generate([[100 + i] * 16 for i in range(n)], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    warmup = time.perf_counter() - t0
    modes = (("eager", eager_code, False), ("compiled", compiled, False), ("fused", eager_code, True))
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode, _, _ in modes}
    for r in range(repeat):  # interleaved: this machine's speed drifts by tens of percent between minutes
        for i, (mode, code, fused) in enumerate(modes):
            use(code)
            model.fused_layers = fused
            runs[mode].append(measure(llm, 1000 + 2000 * (len(modes) * r + i)))
    use(eager_code)
    model.fused_layers = True
    med = {mode: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for mode, ms in runs.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {repeat} interleaved runs; "
          f"compile warm-up {warmup:.1f} s")
    print(f"{'':24}{'eager':>10}{'compiled':>10}{'fused':>10}{'compiled/eager':>16}{'fused/eager':>13}")
    for key, label in (("decode_tok_s", "decode tok/s (1 stream)"), ("prefill_tok_s", "prefill tok/s (512)"),
                       ("step64_ms", "64-request step ms")):
        e, c, f = (med[mode][key] for mode in ("eager", "compiled", "fused"))
        print(f"{label:24}{e:10.1f}{c:10.1f}{f:10.1f}{c / e:16.2f}{f / e:13.2f}")
