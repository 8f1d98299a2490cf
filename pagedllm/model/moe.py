"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE, gpt-oss): a router picks k experts per token, each a
gated MLP kept in the checkpoint's form (dense, or GGUF blocks as stored), and the token's output is the weighted
sum of its experts' outputs. gpt-oss adds biases to the router and the experts and clamps its SwiGLU.

The rows of a step are grouped by expert (a stable counting sort of the (token, slot) pairs), so each chosen
expert multiplies its weights once for all of its tokens and an expert nobody chose costs nothing. Every token's
result depends on its own row alone: its routing is row-local, each expert's GEMM computes a row the same way
whatever else is in it (the kernels' invariant mode), and the k weighted outputs are summed in slot order.

Where every expert keeps its two matrices in GGUF blocks (one type per kind) and the C++ kernels run, the same
steps run as one C++ call (csrc/moe.cpp, in fp32: the same rules, so the same invariance): a Python call per
expert and matrix cost a 2-core CPU more than the experts' bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels import kernel_op
from pagedllm.model.linear import Linear, LinearMethod
from pagedllm.model.mlp import GatedMLP, Glu, swiglu
from pagedllm.quantization.tensor import QuantTensor


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, experts [T, k] int64): softmax over all experts, the k
    most probable (on a tie the lower expert id first, in every batch), renormalised to sum to 1 when asked."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = weights[:, :k], experts[:, :k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def group_by_expert(experts: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor]]:
    """experts [T, k] -> [(expert, its (token * k + slot) indices)] for every expert chosen at least once, in
    expert order, each expert's indices in token order."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    groups, start = [], 0
    for e, n in enumerate(counts):
        if n:
            groups.append((e, order[start:start + n]))
            start += n
    return groups


@dataclass
class ExpertTable:
    """The experts as csrc/moe.cpp takes them: the data pointers of their stored matrices (`matrices` keeps the
    tensors, so that the pointers stay valid), one ggml type per kind, biases stacked [E, n] in fp32."""

    matrices: list[torch.Tensor]
    gate_up: torch.Tensor  # int64 [E]
    down: torch.Tensor  # int64 [E]
    gate_up_qtype: int
    down_qtype: int
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    glu: tuple[int, float, float]


def expert_table(experts: nn.ModuleList, glu: Glu) -> ExpertTable | None:
    """The table of `experts` where each keeps gate|up and down as one block matrix each, of one type per kind
    across the experts, and the glu has a kernel form; else None (the Python form runs)."""
    form = getattr(glu, "kernel_form", None)
    kinds: dict[str, list[QuantTensor]] = {"gate_up": [], "down": []}
    for mlp in experts:
        for kind, found in kinds.items():
            segments = getattr(getattr(mlp, kind), "segments", None)
            if not segments or len(segments) != 1 or not isinstance(segments[0], QuantTensor):
                return None
            found.append(segments[0])
    if form is None or any(len({(m.qtype, tuple(m.shape)) for m in found}) != 1 for found in kinds.values()):
        return None

    def biases(kind: str) -> torch.Tensor | None:
        b = [getattr(mlp, kind).bias for mlp in experts]
        return None if b[0] is None else torch.stack([x.detach().float() for x in b]).contiguous()

    gate_up, down = kinds["gate_up"], kinds["down"]
    return ExpertTable([m.data for m in gate_up + down],
                       torch.tensor([m.data.data_ptr() for m in gate_up], dtype=torch.int64),
                       torch.tensor([m.data.data_ptr() for m in down], dtype=torch.int64),
                       gate_up[0].qtype, down[0].qtype, biases("gate_up"), biases("down"), form)


class SparseMoE(nn.Module):
    """router: Linear(H, E); experts: E gated MLPs of width `intermediate` (bias: on the router and the experts)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 dtype: torch.dtype, method: LinearMethod | None = None, glu: Glu = swiglu, bias: bool = False):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.router = Linear(hidden, num_experts, bias, dtype, method)
        self.experts = nn.ModuleList(GatedMLP(hidden, intermediate, dtype, method, glu, bias)
                                     for _ in range(num_experts))
        self.intermediate, self.glu = intermediate, glu
        self._table: ExpertTable | None | bool = False  # False: not built yet (the weights load after __init__)

    def table(self) -> ExpertTable | None:
        """The experts' table for csrc/moe.cpp (built at the first call, once the weights are loaded), or None
        where they have no kernel form."""
        if self._table is False:
            self._table = expert_table(self.experts, self.glu)
        return self._table

    def fused_experts(self) -> tuple:
        """The arguments to DecoderStack.add_experts (csrc/decoder_layer.cpp), in its order; only where table()
        is not None."""
        t = self.table()
        assert t is not None, "experts without a kernel form run in torch"
        return (*self.router.method.fused_segments(self.router), self.router.bias, t.gate_up, t.down,
                t.gate_up_qtype, t.down_qtype, self.intermediate, t.gate_up_bias, t.down_bias, *t.glu, self.top_k,
                self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.router(x), self.top_k, self.renormalize)
        op = kernel_op("moe_experts")
        if op is not None and (t := self.table()) is not None:
            return op(x.contiguous(), experts.contiguous(), weights.contiguous(), t.gate_up, t.down,
                      t.gate_up_qtype, t.down_qtype, self.intermediate, t.gate_up_bias, t.down_bias, *t.glu)
        k = self.top_k
        w = weights.reshape(-1, 1).to(x.dtype)
        if x.shape[0] == 1:  # one token (a lone decode step): its k experts in slot order, nothing to group
            out = self.experts[int(experts[0, 0])](x) * w[0]
            for j in range(1, k):
                out += self.experts[int(experts[0, j])](x) * w[j]
            return out
        slots = torch.empty(x.shape[0] * k, x.shape[1], dtype=x.dtype, device=x.device)  # row t * k + j: slot j of t
        for e, idx in group_by_expert(experts, self.num_experts):
            slots[idx] = self.experts[e](x[idx // k]) * w[idx]
        slots = slots.view(x.shape[0], k, x.shape[1])
        out = slots[:, 0].clone()
        for j in range(1, k):  # slot order: the same sum for a token in every batch
            out += slots[:, j]
        return out
