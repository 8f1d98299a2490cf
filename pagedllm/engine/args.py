"""Engine configuration: one dataclass shared by the LLM API, the CLI and the server."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass

from pagedllm.dtypes import DTYPES
from pagedllm.quantization import QUANTIZATION

RUNNERS = ("generate", "pooling")


class EngineConfigError(ValueError):
    """Settings that cannot run here (a device torch does not see, a combination refused on a device): the CLI
    prints it as one line."""

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30}


def parse_bytes(value: str | int, name: str = "kv_cache_memory") -> int:
    """'2GiB' -> 2147483648; plain integers are bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name} must look like '2GiB' or '512MiB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_step_ms(value: float | str) -> float | str:
    """'auto' | 'off' | a positive number of milliseconds (a string from the CLI, or a number)."""
    if value in ("auto", "off"):
        return value
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = 0.0
    if not ms > 0 or ms == float("inf"):
        raise ValueError(f"max_step_ms must be 'auto', 'off' or a positive number of milliseconds, got {value!r}")
    return ms


@dataclass
class EngineArgs:
    model: str | None = None  # None: the default model (model/embedded.py: Qwen2.5-Coder-0.5B-Instruct Q4_K_M)
    dtype: str = "auto"  # bf16 where the CPU computes it, else fp32 for weights run as stored (dtypes.auto_dtype)
    block_size: int = 16
    kv_cache_memory: str | int = "2GiB"
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_layout: str = "paged"
    # hybrid models (sliding-window and full layers, e.g. Gemma 3): one block table per KV group, the sliding
    # groups giving back blocks that fell out of their window (core/kv_groups.py); False keeps every block of every
    # layer (the "all global" baseline)
    hybrid_kv_cache: bool = True
    attention_backend: str = "auto"
    # how weights run: "auto" GGUF block formats as stored (HF checkpoints dense), "none" dequantized to dtype (the
    # oracle the transformers comparisons use), "int8" HF float weights as int8 blocks
    quantization: str = "auto"
    # the KV cache: "auto" = the compute dtype, "int8" = int8 rows with a float16 scale per (token, KV head):
    # ~1.9x the blocks of bf16 KV in the same kv_cache_memory (attention/kv_quant.py)
    kv_cache_dtype: str = "auto"
    # every kernel computes a row the same way whatever the batch: tokens do not depend on batching, chunking,
    # the prefix cache or preemption (README: what turning it off trades)
    batch_invariant: bool = True
    seed: int = 0
    speculative_config: dict | None = None  # e.g. {"method": "ngram", "num_speculative_tokens": 4}
    structured_outputs_backend: str = "llguidance"  # or "xgrammar" (see pagedllm/structured/)
    generation_config: str = "auto"  # default sampling from the model ("auto"), none ("vllm"), or a directory
    # scheduling: "fcfs", or "priority" (a request's priority, lower first); each step's prompt tokens sized for a
    # target step time learned from measured step costs ("auto"), a fixed target in ms, or "off" (only
    # max_num_batched_tokens); prompts closest to done first ("shortest") or in arrival order ("fcfs")
    scheduling_policy: str = "fcfs"
    max_step_ms: float | str = "auto"
    prefill_order: str = "shortest"
    # the prefix cache's second tier: cached KV blocks spill to files here and come back on a hit, across restarts
    # and processes (engine/disk_tier.py); None = off. Size: bytes on disk (LRU), e.g. "20GiB"; default 16 GiB
    kv_disk_cache_dir: str | None = None
    kv_disk_cache_size: int | str | None = None
    # "generate" (text generation) or "pooling" (embeddings: prefill only, the prompt's hidden states pooled as the
    # checkpoint says, pagedllm/pooling/config.py), as vLLM's --runner
    runner: str = "generate"
    # LoRA adapters (pagedllm/lora/): at most max_loras distinct adapters run in one step (the model's slots), each
    # of rank max_lora_rank at most, as vLLM's
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # vLLM's hf_overrides; read here: {"classifier_from_token": ["no", "yes"]} makes a causal LM a reranker (the
    # pooling runner scores pairs by those two tokens' logits at the last token, as Qwen3-Reranker)
    hf_overrides: dict | None = None
    # where the model runs: "cpu" (the C++ kernels), "cuda" (dense bf16 weights, Triton/FlexAttention attention,
    # the block pool in GPU memory; engine/placement.py) or "auto" (a GPU where torch sees one)
    device: str = "cpu"
    # on a GPU, the share of its memory the engine may take; the KV pool gets what the weights and a profiled
    # step leave of it (as vLLM's; kv_cache_memory sizes the pool on the CPU)
    gpu_memory_utilization: float = 0.9
    # on a GPU, decode steps run eagerly instead of replaying CUDA graphs (worker/decode_graphs.py), as vLLM's
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {self.dtype!r}")
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {self.kv_layout!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks!r}")
        parse_bytes(self.kv_cache_memory)
        if self.kv_disk_cache_size is not None and parse_bytes(self.kv_disk_cache_size, "kv_disk_cache_size") < 1:
            raise ValueError(f"kv_disk_cache_size must be >= 1 byte, got {self.kv_disk_cache_size!r}")
        if self.quantization not in QUANTIZATION:
            raise ValueError(f"quantization must be one of {', '.join(map(repr, QUANTIZATION))}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'int8', got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(map(repr, RUNNERS))}, got {self.runner!r}")
        if self.prefill_order not in ("shortest", "fcfs"):
            raise ValueError(f"prefill_order must be 'shortest' or 'fcfs', got {self.prefill_order!r}")
        self.max_step_ms = parse_step_ms(self.max_step_ms)
        if not (isinstance(self.device, str) and re.fullmatch(r"cpu|auto|cuda(:\d+)?", self.device)):
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("max_loras", "max_lora_rank"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.speculative_config is not None:
            from pagedllm.engine.speculative import SpeculativeConfig

            SpeculativeConfig.from_dict(self.speculative_config)  # a bad config fails here, before loading

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, positional_model: bool = False, threads: bool = True) -> None:
        """The engine flags, spelled as vLLM's. positional_model: `pagedllm serve MODEL` (--model still works).
        threads=False: the caller adds its own --threads (serve: per data-parallel replica)."""
        d = EngineArgs()
        g = parser.add_argument_group("engine")
        model_help = (".gguf file, HF directory, a hub id in the local HF cache, or an embedded model's name: "
                      "qwen2.5-coder-0.5b-instruct (the default) or smollm2-135m-instruct")
        if positional_model:
            g.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=model_help)
        g.add_argument("--model", default=None, help=model_help)
        g.add_argument("--dtype", default=d.dtype, choices=list(DTYPES),
                       help="compute dtype of weights, activations and KV cache (auto: bfloat16 where the CPU has "
                            "avx512_bf16/AMX or the weights are dense, else float32; bfloat16 on a GPU; float16: on a "
                            "GPU only)")
        g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
        g.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                       help="memory for the KV cache, e.g. 2GiB (sizes the block pool)")
        g.add_argument("--num-kv-blocks", type=int, default=None,
                       help="number of KV blocks (overrides --kv-cache-memory)")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests running at once")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="token budget of one engine step")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output (default: the model's context length)")
        g.add_argument("--enable-prefix-caching", default=d.enable_prefix_caching,
                       action=argparse.BooleanOptionalAction, help="reuse the KV blocks of shared prompt prefixes")
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help=argparse.SUPPRESS)  # the old spelling
        g.add_argument("--enable-chunked-prefill", default=d.enable_chunked_prefill,
                       action=argparse.BooleanOptionalAction,
                       help="split long prompts over several steps, batched with decodes")
        g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                       help=argparse.SUPPRESS)  # the old spelling
        g.add_argument("--kv-layout", default=d.kv_layout, choices=["paged", "contiguous"],
                       help="contiguous reserves max-model-len per request up front (the baseline)")
        g.add_argument("--hybrid-kv-cache", default=d.hybrid_kv_cache, action=argparse.BooleanOptionalAction,
                       help="sliding-window layers give back the KV blocks that fell out of their window "
                            "(--no-hybrid-kv-cache: keep every block of every layer)")
        g.add_argument("--attention-backend", default=d.attention_backend,
                       help="auto, reference (the pure-torch oracle) or a kernel name")
        g.add_argument("--quantization", default=d.quantization, choices=QUANTIZATION,
                       help="auto: GGUF weights as stored where the CPU has VNNI or AVX2 (else dequantized where they "
                            "fit); "
                            "gguf: as stored on every CPU; none: dequantize; int8: HF weights in int8 blocks")
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "int8"],
                       help="auto: the KV cache in the compute dtype; int8: int8 K/V with a scale per token and "
                            "KV head (about half the bytes of bf16, twice the blocks)")
        g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=d.batch_invariant,
                       help="outputs independent of batching, chunking and the prefix cache")
        g.add_argument("--seed", type=int, default=d.seed, help="seed of the engine's sampler")
        g.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                            '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\'')
        g.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"],
                       help="fcfs: arrival order; priority: a request's priority field first (lower first)")
        g.add_argument("--max-step-ms", default=d.max_step_ms, metavar="auto|off|MS",
                       help="target time of one engine step, which sizes its prompt tokens: auto (learned: twice a "
                            "decode step while requests decode), a number of milliseconds, or off (only "
                            "--max-num-batched-tokens)")
        g.add_argument("--prefill-order", default=d.prefill_order, choices=["shortest", "fcfs"],
                       help="which prompts get a step's budget first: the closest to done (the first token sooner "
                            "on average; no prompt waits more than a few steps) or arrival order")
        g.add_argument("--generation-config", default=d.generation_config,
                       help="default sampling parameters: 'auto' = the model's generation_config.json / GGUF "
                            "sampling keys, 'vllm' = none, or a directory with a generation_config.json")
        g.add_argument("--kv-disk-cache-dir", default=None, metavar="DIR",
                       help="a second tier for the prefix cache: KV blocks the RAM cache evicts are written here "
                            "and read back on a prefix hit, also after a restart and by other processes (off by "
                            "default)")
        g.add_argument("--kv-disk-cache-size", default=None, metavar="BYTES",
                       help="most bytes the disk tier keeps (least recently used go first), e.g. 20GiB "
                            "(default 16GiB)")
        g.add_argument("--runner", default=d.runner, choices=list(RUNNERS),
                       help="generate: text generation; pooling: embeddings and scores (POST /v1/embeddings, "
                            "/v1/score, /v1/rerank; LLM.embed, LLM.score)")
        g.add_argument("--enable-lora", action="store_true", default=d.enable_lora,
                       help="serve LoRA adapters (--lora-modules, POST /v1/load_lora_adapter, LLM lora_request)")
        g.add_argument("--max-loras", type=int, default=d.max_loras,
                       help="most distinct LoRA adapters in one batch (requests of others wait)")
        g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                       help="largest LoRA rank an adapter may have")
        g.add_argument("--hf-overrides", type=json.loads, default=None, metavar="JSON",
                       help='as vLLM\'s; \'{"classifier_from_token": ["no", "yes"]}\' serves a causal LM as a '
                            'reranker (Qwen3-Reranker) with --runner pooling')
        g.add_argument("--device", default=d.device, metavar="cpu|cuda|auto",
                       help="where the model runs: cpu (the C++ kernels, GGUF blocks as stored), cuda (bf16 weights "
                            "and the KV cache on the GPU) or auto (a GPU where torch sees one)")
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                       help="share of the GPU's memory the engine may take (weights, activations, the KV cache)")
        g.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                       help="on a GPU, run decode steps eagerly (no CUDA graphs)")
        if threads:
            g.add_argument("--threads", type=int, default=None,
                           help="CPU threads for the model (torch.set_num_threads; default: torch's choice)")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        if getattr(ns, "model_tag", None) is not None:
            if ns.model is not None and ns.model != ns.model_tag:
                raise SystemExit(f"error: two models given: {ns.model_tag!r} and --model {ns.model!r}")
            ns.model = ns.model_tag
        if getattr(ns, "threads", None):
            import torch

            torch.set_num_threads(ns.threads)
        names = [f.name for f in dataclasses.fields(cls)]
        try:
            return cls(**{n: getattr(ns, n) for n in names if hasattr(ns, n)})
        except ValueError as e:  # a bad flag value: one line, as argparse reports its own
            raise EngineConfigError(str(e)) from None
