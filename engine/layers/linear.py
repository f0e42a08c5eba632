"""Linear layers split for tensor parallelism: column-parallel (QKV, merged gate/up) and row-parallel.

Weights are stored as this rank's shard; each parameter's `weight_loader(param, loaded, shard_id)`
narrows a full checkpoint tensor to that shard, so loading never holds more than one tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import gemv
from engine.layers.distributed import all_reduce, resolve_tp


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}: {a} is not divisible by tensor_parallel_size {b}")
    return a // b


class LinearBase(nn.Module):
    """y = x W^T (+ b) with W of shape (output_size_per_rank, input_size_per_rank). With impl "triton"
    (set by the model runner), batches of up to gemv.MAX_ROWS rows go to the Triton GEMV kernel."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp_rank: int | None,
        tp_size: int | None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.impl = "torch"

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.impl == "triton" and gemv.serves(x, self.weight):
            return gemv.linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, 0, 1)


class ColumnParallelLinear(LinearBase):
    """Splits the output features over ranks; each rank's output is its slice (no communication)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        _, size = resolve_tp(tp_rank, tp_size)
        super().__init__(input_size, _divide(output_size, size, "output_size"), bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        n = param.data.size(0)
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matrix (gate and up)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        _, size = resolve_tp(tp_rank, tp_size)
        for i, n in enumerate(output_sizes):
            _divide(n, size, f"output_sizes[{i}]")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear: bad shard_id {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix, split by heads (KV heads replicated when tp > num_kv_heads)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        _, size = resolve_tp(tp_rank, tp_size)
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, size, "num_heads")
        self.num_kv_heads = max(1, num_kv_heads // size)
        self.kv_replicas = max(1, size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * size
        super().__init__(hidden_size, out, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp_rank
        elif shard_id == "k":
            offset, size, index = q_size, kv_size, self.tp_rank // self.kv_replicas
        elif shard_id == "v":
            offset, size, index = q_size + kv_size, kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"QKVParallelLinear: bad shard_id {shard_id!r} (one of 'q', 'k', 'v')")
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, index * size, size))


class RowParallelLinear(LinearBase):
    """Splits the input features over ranks; partial outputs are summed by an all-reduce."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        _, size = resolve_tp(tp_rank, tp_size)
        super().__init__(_divide(input_size, size, "input_size"), output_size, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 1:  # bias: added once, after the reduction
            param.data.copy_(loaded)
            return
        n = param.data.size(1)
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return all_reduce(self.matmul(x, bias), self.tp_size)

    def silu_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """forward(silu(gate) * up) of a merged [M, 2I] gate/up row block, fused into the Triton GEMV
        (callers check `gemv.serves` first)."""
        bias = self.bias if self.tp_rank == 0 else None
        return all_reduce(gemv.silu_linear(gate_up, self.weight, bias), self.tp_size)
