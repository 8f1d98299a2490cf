"""Turns a scheduled batch into flat tensors, runs the model over the paged KV cache and samples: one step's
execution, schedule -> **execute** -> update (core/step.py)."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from pagedllm.attention import AttentionBackend, copy_blocks, get_backend
from pagedllm.attention.metadata import AttentionMetadata, build_attention_metadata, compute_positions
from pagedllm.core.kv_groups import KVGroupLayout
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.core.step import RunnerOutput
from pagedllm.kernels import KernelMode, forward_context, kernel_op
from pagedllm.lora.manager import LoRAManager
from pagedllm.model.config import ModelConfig
from pagedllm.model.kv_cache import allocate_kv_caches
from pagedllm.model.pooling_config import PoolingConfig
from pagedllm.worker.decode_graphs import DecodeGraphs
from pagedllm.worker.pooler import Pooler, finish_embedding
from pagedllm.worker.prompt_logprobs import prompt_logprobs
from pagedllm.worker.sampler import Sampler, SamplingRow, TokenBitmask
from pagedllm.worker.step_upload import StepUpload


def sampling_rows(scheduled: list[ScheduledRequest]) -> tuple[list[SamplingRow], list[int]]:
    """The sampler's rows for the entries that sample, and the logits row each reads: an entry's last token and
    each draft prefix (row j conditioned on the first j drafts), or one row per sample when it forks n samples
    (all from its one logits row, each with its own seed)."""
    rows: list[SamplingRow] = []
    logit_rows: list[int] = []
    logit_row = 0
    for s in scheduled:
        req = s.request
        if s.forks:
            for i in range(s.num_rows):
                rows.append(SamplingRow(req.sampling_params, req.prompt_token_ids, [],
                                        None if req.seed is None else req.seed + i))
                logit_rows.append(logit_row)
        elif s.num_logits:  # (a prefill-only entry has none)
            out, drafts = req.output_token_ids, s.draft_token_ids
            for j in range(len(drafts) + 1):
                rows.append(SamplingRow(req.sampling_params, req.prompt_token_ids,
                                        out + drafts[:j] if j else out, req.seed))
                logit_rows.append(logit_row + j)
        logit_row += s.num_logits
    return rows, logit_rows


def _all_finite(logits: torch.Tensor) -> bool:
    op = kernel_op("all_finite")
    if op is not None and logits.is_cpu and logits.dtype == torch.float32 and logits.is_contiguous():
        return op(logits)
    return math.isfinite(logits.sum().item())


def nonfinite_entries(scheduled: list[ScheduledRequest], logits: torch.Tensor) -> list[int]:
    """The entries whose logits rows hold a NaN or an infinity (one reduction per row: any makes the row's sum so):
    the engine fails those requests instead of sampling from them."""
    if not logits.numel() or _all_finite(logits):  # one pass over the whole batch: the usual case
        return []
    finite = torch.isfinite(logits.sum(-1)).cpu()
    bad, row = [], 0
    for i, s in enumerate(scheduled):
        if s.num_logits and not bool(finite[row:row + s.num_logits].all()):
            bad.append(i)
        row += s.num_logits
    return bad


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, *, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, attention_backend: str | AttentionBackend = "auto",
                 batch_invariant: bool = True, layout: KVGroupLayout | None = None, seed: int = 0,
                 pooling: PoolingConfig | None = None, lora: LoRAManager | None = None,
                 device: torch.device | str = "cpu") -> None:
        """The settings after the model and its config are keywords: several are ints or bools, which a positional
        call could swap unseen. kv_dtype: the KV pool's dtype (the compute dtype, or torch.int8:
        model/kv_cache.resolve_kv_dtype). layout: the KV groups (core/kv_groups.py; None: one group of every
        layer). seed: the sampler's generator (rows without a seed of their own). pooling: how prefill-only
        requests pool their hidden states (the pooling runner; None: the engine only generates). lora: the
        adapters' slots (None: LoRA off). device: where the model's weights are and the KV pool goes.

        The attention backend decides the path: beside the C++ CPU backend every layer may run its C++ kernel;
        beside a device backend (FlexAttention, Triton) the model runs in torch ops on `device`, its inputs copied
        there once per step (StepUpload), and only the sampled tokens come back: the GPU's path, which the
        tests run on the CPU."""
        self.model = model
        self.lora = lora
        self.device = torch.device(device)
        self.block_size = block_size
        self.backend = (get_backend(attention_backend, self.device) if isinstance(attention_backend, str)
                        else attention_backend)
        cpu_kernels = bool(getattr(self.backend, "cpu_kernels", False)) and self.device.type == "cpu"
        # every forward runs in it (engines may differ)
        self.kernel_mode = KernelMode(invariant=batch_invariant, cpu_kernels=cpu_kernels)
        self.upload = None if cpu_kernels else StepUpload(self.device)
        # the device path's pool has one block past the block manager's: padding rows of a decode graph write there
        self.scratch_block = None if cpu_kernels else num_blocks
        self.kv_caches = allocate_kv_caches(config, block_size, kv_dtype, layout=layout, device=self.device,
                                            num_blocks=num_blocks if cpu_kernels else num_blocks + 1)
        self.decode_graphs: DecodeGraphs | None = None
        self.num_groups = layout.num_groups if layout else 1
        if hasattr(model, "set_attention_backend"):
            model.set_attention_backend(self.backend)
        self.sampler = Sampler(seed)
        self.pooler = Pooler(pooling, block_size) if pooling is not None else None
        # Logits land in one reused buffer: glibc maps every allocation over 32 MB afresh, so a fresh
        # [rows, vocab] float32 tensor per step would page-fault all of it in again at large batches
        # (the 256-running decode step of `pagedllm bench engine` measures it).
        self.vocab_size = config.vocab_size
        # 2-D even when empty: a step may sample no row
        self._logits = torch.empty(0, self.vocab_size, device=self.device)

    def _pooled(self, vector: torch.Tensor, req, dtype: torch.dtype) -> list[float]:
        """An embedding, or for a decoder reranker (PoolingConfig.score_tokens) its score: softmax over the "no" and
        "yes" tokens' logits at the last token, i.e. sigmoid(yes - no), as vLLM's Qwen3-Reranker."""
        tokens = self.pooler.config.score_tokens
        if tokens is None:
            return finish_embedding(vector, self.pooler.config, req.sampling_params)
        logits = self.model.compute_logits(vector[None].to(dtype))[0]
        return [torch.sigmoid(logits[tokens[1]] - logits[tokens[0]]).item()]

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], block_copies: list[tuple[int, int]],
                token_bitmask: TokenBitmask | None = None) -> RunnerOutput:
        """Run one step over the scheduled entries (each with its block tables) and sample every row they have
        (sampling_rows); also the prompt logprobs of the prompt tokens computed this step, where asked for."""
        with forward_context(self.kernel_mode):
            logits, hidden = self.forward(scheduled, block_copies)
            out = RunnerOutput(prompt_logprobs=prompt_logprobs(self.model, hidden, scheduled),
                               nonfinite=nonfinite_entries(scheduled, logits))
            if self.pooler is not None:
                out.pooled = {req.request_id: self._pooled(v, req, hidden.dtype)
                              for req, v in self.pooler(scheduled, hidden)}
            rows, logit_rows = sampling_rows(scheduled)
            if rows:
                identity = logit_rows == list(range(len(logits)))  # no forks: skip a [rows, vocab] copy
                out.sampled = self.sampler(logits if identity else logits[logit_rows], rows, token_bitmask)
        return out

    @torch.inference_mode()
    def profile_step(self, num_tokens: int, num_rows: int) -> None:
        """One forward of the largest step (one prompt of num_tokens tokens over this runner's pool, which must
        hold them) and its logits for num_rows rows: what a GPU's KV budget subtracts (engine/kv_budget.py)."""
        blocks = list(range(-(-num_tokens // self.block_size)))
        positions = compute_positions([0], [num_tokens])
        metas = [build_attention_metadata([blocks], [0], [num_tokens], self.block_size, positions)] * self.num_groups
        ids = [i % self.vocab_size for i in range(num_tokens)]
        with forward_context(self.kernel_mode):
            hidden = self.model(*self._model_inputs(ids, positions, metas))
            rows = hidden[-1:].expand(min(num_rows, num_tokens), -1).contiguous()
            self.model.compute_logits(rows).log_softmax(-1)  # (the sampler's largest temporary)

    def _model_inputs(self, token_ids: list[int], positions: np.ndarray, metas: list[AttentionMetadata]) -> tuple:
        """The model's arguments: token ids, positions, the KV caches and the metadata (one, or one per layer),
        on the model's device."""
        if self.upload is None:
            ids, pos = torch.tensor(token_ids, dtype=torch.int64), torch.from_numpy(positions)
        else:
            ids, pos, metas = self.upload(token_ids, positions, metas)
        return ids, pos, self.kv_caches, metas[0] if len(metas) == 1 else [metas[g] for g in self.kv_caches.layer_group]

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool) -> bool:
        """Decode steps on static buffers (worker/decode_graphs.py), captured as CUDA graphs where `capture`;
        False (eager steps) where this model or backend cannot be captured: values read back in the forward
        (mixtures of experts, LongRoPE's switch), LoRA, the CPU kernels' path, a backend not marked capturable."""
        rotary = getattr(self.model, "rotary", None)
        if (self.scratch_block is None or self.lora is not None or self.model.config.num_experts
                or getattr(rotary, "switch", None) is not None
                or (capture and not getattr(self.backend, "cuda_graphs", False))):
            return False
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.kv_caches.layer_group, self.num_groups,
                                          self.block_size, max_num_seqs, max_model_len, self.scratch_block,
                                          self.device, capture)
        return True

    def _adapters(self, scheduled: list[ScheduledRequest]) -> contextlib.AbstractContextManager:
        """The LoRA adapter of every new token's row (a no-op without adapters)."""
        if self.lora is None or all(s.request.lora_id is None for s in scheduled):
            return contextlib.nullcontext()
        return self.lora.batch([s.request.lora_id for s in scheduled for _ in range(s.num_new_tokens)])

    def forward(self, scheduled: list[ScheduledRequest],
                block_copies: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 logits for the rows that have them (each sampling entry's last 1 + draft tokens, in order; in a
        buffer the next call overwrites) and every new token's hidden state, in scheduled order."""
        if block_copies:
            copy_blocks(self.kv_caches, block_copies)
        num_computed = [s.request.num_computed_tokens for s in scheduled]
        num_new = [s.num_new_tokens for s in scheduled]
        token_ids: list[int] = []
        logit_rows: list[int] = []
        for s, c in zip(scheduled, num_computed, strict=True):
            token_ids.extend(s.request.all_token_ids[c:c + s.num_new_tokens - s.num_draft_tokens])
            token_ids.extend(s.draft_token_ids)
            logit_rows.extend(range(len(token_ids) - s.num_logits, len(token_ids)))
        positions = compute_positions(num_computed, num_new)
        tables = [[s.block_ids[g] for s in scheduled] for g in range(self.num_groups)]
        bucket = self.decode_graphs.bucket(num_new, tables) if self.decode_graphs is not None else None
        if bucket is not None:
            hidden = self.decode_graphs.run(bucket, token_ids, positions, tables)
        else:
            metas = [build_attention_metadata(t, num_computed, num_new, self.block_size, positions) for t in tables]
            with self._adapters(scheduled):
                hidden = self.model(*self._model_inputs(token_ids, positions, metas))
        if not logit_rows:  # a step of prefill chunks only
            return torch.empty(0, self.vocab_size, device=self.device), hidden
        if self._logits.shape[0] < len(logit_rows):
            self._logits = torch.empty(len(logit_rows), self.vocab_size, dtype=torch.float32, device=self.device)
        # logit rows are increasing and distinct: as many as the tokens means every token (a decode step), no gather
        rows = hidden if len(logit_rows) == len(hidden) else \
            hidden[torch.tensor(logit_rows, dtype=torch.int64).to(self.device)]
        return self.model.compute_logits(rows, out=self._logits[:len(logit_rows)]), hidden
