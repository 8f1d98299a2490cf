"""The quantized LinearMethod: a Linear's weight kept as its checkpoint shards in stored block form (repacked
into the kernel's 16-row groups where the type has that form: the same bytes, another order).

A fused Linear (q|k|v, gate|up) holds one segment per checkpoint tensor, each in its own ggml type (a Q4_K_M file
stores attn_v as Q6_K next to Q4_K q/k): `apply` runs the quantized GEMM once per segment into that segment's
output columns. A shard that arrives in a float type (an F16/F32 tensor in a GGUF file) stays a dense matrix of
the compute dtype, unless the method quantizes floats (`quantization="int8"` on HF checkpoints: Q8_0 blocks).
"""

from __future__ import annotations

import torch

from pagedllm.model.layers import linear
from pagedllm.model.linear import Linear, LinearMethod, load_dense
from pagedllm.quantization.tensor import QuantTensor, pack_stacked, quantize_q8_0

Segment = QuantTensor | torch.Tensor


class QuantizedLinearMethod(LinearMethod):
    """GGUF blocks as stored; with quantize_floats, float shards become Q8_0 at load (the int8 mode)."""

    runs_fused_layer = True  # through DecoderStack, which takes fused_segments()
    segmented = True

    def __init__(self, quantize_floats: bool = False):
        self.quantize_floats = quantize_floats

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        layer.segments = [None] * len(layer.output_sizes)  # filled by load_weight, one per shard
        layer.compute_dtype = dtype

    def load_weight(self, layer: Linear, tensor: torch.Tensor | QuantTensor, rows: slice | None, name: str) -> None:
        if rows is None and len(layer.segments) > 1:
            raise ValueError(f"weight {name!r}: a fused weight must arrive as its checkpoint shards")
        shard = 0 if rows is None else _shard_index(layer, rows)
        want = (layer.output_sizes[shard], layer.input_size)
        if tuple(tensor.shape) != want:
            raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match the config ({want})")
        if isinstance(tensor, QuantTensor):
            layer.segments[shard] = tensor  # packed after loading, together with its packable neighbours
        elif self.quantize_floats and tensor.shape[1] % 32 == 0:
            layer.segments[shard] = quantize_q8_0(tensor)
        else:
            dense = torch.empty(want, dtype=layer.compute_dtype)
            load_dense(dense, tensor, name)
            layer.segments[shard] = dense

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Neighbouring packable shards of one type are packed into one matrix (q|k|v, gate|up: one kernel call,
        one quantization of the activations); a packed matrix is whole 16-row groups, so they simply stack."""
        runs: list[list[Segment]] = []
        for seg in layer.segments:
            prev = runs[-1][-1] if runs else None
            if _packable(seg) and _packable(prev) and prev.qtype == seg.qtype:
                runs[-1].append(seg)
            else:
                runs.append([seg])
        layer.segments = [pack_stacked(run) if _packable(run[0]) else run[0] for run in runs]

    def fused_segments(self, layer: Linear) -> tuple[list[torch.Tensor], list[int]]:
        segs = layer.segments
        return ([s.data if isinstance(s, QuantTensor) else s for s in segs],
                [s.qtype if isinstance(s, QuantTensor) else 0 for s in segs])

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if len(layer.segments) == 1 and isinstance(layer.segments[0], QuantTensor):
            out = layer.segments[0].matmul(x)
        else:
            out = torch.empty(x.shape[0], layer.output_size, dtype=x.dtype)
            start = 0
            for seg in layer.segments:
                n = seg.shape[0]
                if isinstance(seg, QuantTensor):
                    seg.matmul(x, out[:, start:start + n])
                else:
                    out[:, start:start + n] = linear(x, seg)
                start += n
        return out if bias is None else out.add_(bias)


def _shard_index(layer: Linear, rows: slice) -> int:
    """The index of the shard that starts at rows.start."""
    start = 0
    for i, n in enumerate(layer.output_sizes):
        if start == rows.start:
            return i
        start += n
    raise ValueError(f"no shard of {layer.output_sizes} starts at row {rows.start}")


def weight_bytes(layer: Linear) -> int:
    """Resident bytes of a quantized Linear's weight (for memory reports)."""
    return sum(s.nbytes if isinstance(s, QuantTensor) else s.numel() * s.element_size() for s in layer.segments)


def _packable(seg: Segment | None) -> bool:
    return isinstance(seg, QuantTensor) and seg.packable
