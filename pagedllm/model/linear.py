"""Linear layers and the seam for how they compute (after vLLM's LinearMethod / quant_method).

A `Linear` owns its shape (input_size, output_sizes) and an optional bias; a `LinearMethod` object decides how the
weight is stored and applied: `create_weights` registers the layer's weight tensors, `load_weight` takes a
checkpoint tensor (all of the weight, or one shard of a fused weight), `process_weights_after_loading` may repack
once everything is in, and `apply` computes x W^T + b. `DenseLinearMethod` (bf16/fp32 weights, F.linear or the
small-GEMM kernel) is the default; quantized formats are further methods.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.layers import frozen_param, linear


def load_dense(param: nn.Parameter, tensor: torch.Tensor, name: str, rows: slice | None = None) -> None:
    """Put a checkpoint tensor into `param` (adopted without a copy when its dtype already matches), or into
    `rows` of it. ValueError naming the checkpoint tensor when its shape does not fit."""
    want = tuple(param.shape) if rows is None else (rows.stop - rows.start, *param.shape[1:])
    if tuple(tensor.shape) != want:
        raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match the config ({want})")
    if rows is None:
        param.data = tensor.to(param.dtype).contiguous()
    else:
        param.data[rows].copy_(tensor)


class LinearMethod:
    """How a Linear stores and computes its weight. Stateless: one instance may serve every layer."""

    # The fused C++ decoder layer reads each weight as `layer.weight` (a dense matrix of the model's dtype) or,
    # for a segmented method, as fused_segments(): only methods that keep such a weight may run there (a model
    # with any other method runs its layers in torch; model/fused_layer.py decides).
    runs_fused_layer: bool = False
    segmented: bool = False

    def fused_segments(self, layer: Linear) -> tuple[list[torch.Tensor], list[int]]:
        """The fused decoder-layer op's view of the weight: segment tensors and their ggml types (0: dense)."""
        return [layer.weight], [0]

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def load_weight(self, layer: Linear, tensor: torch.Tensor, rows: slice | None, name: str) -> None:
        """`tensor` is the whole weight (rows None) or the shard that goes into `rows` of it."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Called once after the checkpoint is loaded (repacking, scale folding)."""

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class DenseLinearMethod(LinearMethod):
    """An unquantized [out, in] weight of the model's dtype."""

    runs_fused_layer = True

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        layer.weight = frozen_param(layer.output_size, layer.input_size, dtype=dtype)

    def load_weight(self, layer: Linear, tensor: torch.Tensor, rows: slice | None, name: str) -> None:
        load_dense(layer.weight, tensor, name, rows)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)


DENSE = DenseLinearMethod()


class Linear(nn.Module):
    """y = x W^T (+ b). W may stack several checkpoint tensors by rows (output_sizes: q|k|v, gate|up); shard k
    of it is rows sum(output_sizes[:k]) .. + output_sizes[k]. row_orders: per shard, None or the order in which to
    keep the checkpoint's rows (weight and bias), applied as they load."""

    def __init__(self, input_size: int, output_sizes: int | list[int], bias: bool, dtype: torch.dtype,
                 method: LinearMethod | None = None, row_orders: list[torch.Tensor | None] | None = None):
        super().__init__()
        self.row_orders = row_orders
        self.input_size = input_size
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.method = method or DENSE
        self.method.create_weights(self, dtype)
        self.bias = frozen_param(self.output_size, dtype=dtype) if bias else None
        self.lora = None  # its LoRA slots (lora/layers.LoRAStack) once the engine enables LoRA

    def shard_rows(self, shard: int | None) -> slice | None:
        if shard is None:
            return None
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None, name: str) -> None:
        order = self.row_orders[shard or 0] if self.row_orders else None
        if order is not None:
            if tensor.shape[0] != order.numel():
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match the config "
                                 f"({order.numel()} rows)")
            tensor = tensor.rows(order) if hasattr(tensor, "rows") else tensor[order]
        if param_name == "bias":
            load_dense(self.bias, tensor, name, self.shard_rows(shard))
        else:
            self.method.load_weight(self, tensor, self.shard_rows(shard), name)

    def has(self, param_name: str) -> bool:
        """Whether the checkpoint tensor `param_name` ("weight" or "bias") belongs to this layer."""
        return param_name == "weight" or (param_name == "bias" and self.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora(x, out)
