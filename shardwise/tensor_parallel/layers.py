"""Tensor-parallel layers (Megatron, arXiv 1909.08053) over a :class:`~shardwise.comm.Comm`.

Every collective goes through the TP group's ``Comm`` so ``comm_stats()`` counts it. The four
autograd functions are Megatron's conjugate pairs: ``copy_to_tp`` (f: identity forward, all-reduce
backward) sits before a column-parallel matmul, ``reduce_from_tp`` (g: all-reduce forward,
identity backward) after a row-parallel one; with both in place every replicated tensor (the
residual stream, norms, row-parallel biases) sees identical values *and* identical gradients on
all TP ranks, so replicated parameters need no gradient all-reduce.

Layers are built by slicing an existing full ``nn.Linear`` / ``nn.Embedding`` / GPT-2 ``Conv1D``
weight (``from_module``), keeping the original layout and parameter names, so state dicts,
optimizers and checkpoints see the same names (with local shapes) and results are comparable to
the unsharded model. Each sharded parameter carries a :class:`ShardSpec` as ``p._tp_spec``.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.comm import Comm


# -- how a parameter is cut -------------------------------------------------------------------
@dataclass(frozen=True)
class ShardSpec:
    """Where this rank's slice of a full tensor lies along ``dim``.

    The full size ``full`` is padded up to a multiple of ``size`` (vocabularies such as 509);
    ``parts`` > 1 describes fused tensors (GPT-2 ``c_attn`` = q|k|v): each part is cut
    separately and this rank's pieces are concatenated, so heads stay whole.
    """

    dim: int
    full: int
    size: int
    rank: int
    parts: int = 1

    @property
    def padded(self) -> int:
        return -(-self.full // self.size) * self.size

    @property
    def local(self) -> int:
        return self.padded // self.size

    def pieces(self) -> list[tuple[int, int, int]]:
        """``(src_start, src_stop, dst_start)`` ranges of the full tensor this rank holds."""
        if self.parts > 1:
            part = self.full // self.parts
            n = part // self.size
            return [(j * part + self.rank * n, j * part + (self.rank + 1) * n, j * n)
                    for j in range(self.parts)]
        start = self.rank * self.local
        stop = min(start + self.local, self.full)
        return [(start, stop, 0)] if stop > start else []

    def for_rank(self, rank: int) -> ShardSpec:
        return ShardSpec(self.dim, self.full, self.size, rank, self.parts)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full`` (padding rows zero); works on meta tensors too."""
        shape = list(full.shape)
        shape[self.dim] = self.local
        out = full.new_zeros(shape)
        for a, b, d in self.pieces():
            out.narrow(self.dim, d, b - a).copy_(full.narrow(self.dim, a, b - a))
        return out


def check_divisible(what: str, n: int, size: int, parts: int = 1) -> None:
    if n % (parts * size):
        per = f" per each of {parts} fused parts ({n // parts} each)" if parts > 1 else ""
        raise ValueError(f"tensor parallel size {size} does not divide {what} = {n}{per}; "
                         f"choose a degree that divides it")


def _mark(p: nn.Parameter, spec: ShardSpec | None) -> nn.Parameter:
    p._tp_spec = spec  # type: ignore[attr-defined]
    return p


# -- Megatron's f and g, and the gather/scatter pair --------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: Comm) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous().clone()
        ctx.tp.all_reduce(g)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: Comm) -> torch.Tensor:
        x = x.contiguous().clone()
        tp.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def _gather_last(x: torch.Tensor, tp: Comm) -> torch.Tensor:
    buf = x.new_empty((tp.size, *x.shape))
    buf[tp.rank].copy_(x)
    tp.all_gather(buf.view(-1))
    return buf.movedim(0, -2).reshape(*x.shape[:-1], tp.size * x.shape[-1])


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: Comm) -> torch.Tensor:
        ctx.tp, ctx.n = tp, x.shape[-1]
        return _gather_last(x, tp)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g.narrow(-1, ctx.tp.rank * ctx.n, ctx.n).contiguous(), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: Comm) -> torch.Tensor:
        ctx.tp = tp
        n = x.shape[-1] // tp.size
        return x.narrow(-1, tp.rank * n, n).contiguous()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _gather_last(g.contiguous(), ctx.tp), None


def copy_to_tp(x: torch.Tensor, tp: Comm) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward."""
    return _CopyToTP.apply(x, tp) if tp.size > 1 else x


def reduce_from_tp(x: torch.Tensor, tp: Comm) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, tp) if tp.size > 1 else x


def gather_from_tp(x: torch.Tensor, tp: Comm) -> torch.Tensor:
    """Concatenate the ranks' last-dim shards forward; keep this rank's slice of the gradient."""
    return _GatherFromTP.apply(x, tp) if tp.size > 1 else x


def scatter_to_tp(x: torch.Tensor, tp: Comm) -> torch.Tensor:
    """Keep this rank's last-dim slice forward; all-gather the gradient backward."""
    return _ScatterToTP.apply(x, tp) if tp.size > 1 else x


class SharedCopy:
    """One f for sibling column-parallel layers that read the same input (q, k, v; gate, up).

    Each layer applying its own f would all-reduce the input gradient once per sibling (3x in
    attention with separate q/k/v projections); sharing the f output sums their gradients locally
    and all-reduces once, as Megatron's fused QKV does. The shared output is dropped once every
    member has used it, so nothing is kept alive between forwards.
    """

    def __init__(self) -> None:
        self.members = 0
        self._x: weakref.ref | None = None
        self._y: torch.Tensor | None = None
        self._uses = 0

    def __call__(self, x: torch.Tensor, tp: Comm) -> torch.Tensor:
        if self._y is None or self._x is None or self._x() is not x:
            self._x, self._y, self._uses = weakref.ref(x), copy_to_tp(x, tp), 0
        y = self._y
        self._uses += 1
        if self._uses >= max(1, self.members):
            self._x, self._y = None, None
        return y


# -- layers --------------------------------------------------------------------------------------
def _weight_of(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(weight, bias, transposed): GPT-2's Conv1D stores [in, out], nn.Linear [out, in]."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias, False
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight, module.bias, True
    raise TypeError(f"cannot tensor-parallelize {type(module).__name__}: expected nn.Linear or Conv1D")


class _ParallelLinear(nn.Module):
    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, transposed: bool, tp: Comm):
        super().__init__()
        self.tp, self.transposed = tp, transposed
        self.weight = weight
        self.bias = bias

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.transposed:
            shape = (*x.shape[:-1], self.weight.shape[1])
            x2 = x.reshape(-1, x.shape[-1])
            y = torch.addmm(bias, x2, self.weight) if bias is not None else x2 @ self.weight
            return y.view(shape)
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(_ParallelLinear):
    """Output features split over TP ranks; ``gather_output`` concatenates them (and trims padding).

    ``parts`` > 1 cuts a fused projection part by part (q|k|v); ``pad`` allows output sizes not
    divisible by the degree (only with a vocabulary head; padded outputs are zero).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: Comm, *, out_features: int,
                 transposed: bool = False, gather_output: bool = False):
        super().__init__(weight, bias, transposed, tp)
        self.out_features, self.gather_output = out_features, gather_output
        self.shared_copy = SharedCopy()  # apply_tensor_parallel gives siblings one instance

    @classmethod
    def from_module(cls, module: nn.Module, tp: Comm, *, gather_output: bool = False, parts: int = 1,
                    pad: bool = False, name: str = "") -> ColumnParallelLinear:
        w, b, tr = _weight_of(module)
        dim = 1 if tr else 0
        out = w.shape[dim]
        if not pad or parts > 1:
            check_divisible(f"the output features of {name or type(module).__name__}", out, tp.size, parts)
        spec = ShardSpec(dim, out, tp.size, tp.rank, parts)
        weight = _mark(nn.Parameter(spec.take(w.detach()), w.requires_grad), spec)
        bias = None
        if b is not None:
            bspec = ShardSpec(0, out, tp.size, tp.rank, parts)
            bias = _mark(nn.Parameter(bspec.take(b.detach()), b.requires_grad), bspec)
        return cls(weight, bias, tp, out_features=out, transposed=tr, gather_output=gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(self.shared_copy(x, self.tp), self.bias)
        if not self.gather_output:
            return y
        y = gather_from_tp(y, self.tp)
        return y[..., : self.out_features] if y.shape[-1] != self.out_features else y

    def extra_repr(self) -> str:
        return f"out_features={self.out_features}, tp={self.tp.size}, gather_output={self.gather_output}"


class RowParallelLinear(_ParallelLinear):
    """Input features split over TP ranks; partial outputs summed by an all-reduce (g).

    ``input_is_parallel=False`` first keeps this rank's slice of a replicated input. The bias is
    replicated and added once, after the sum.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: Comm, *, transposed: bool = False,
                 input_is_parallel: bool = True):
        super().__init__(weight, bias, transposed, tp)
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_module(cls, module: nn.Module, tp: Comm, *, input_is_parallel: bool = True,
                    name: str = "") -> RowParallelLinear:
        w, b, tr = _weight_of(module)
        dim = 0 if tr else 1
        check_divisible(f"the input features of {name or type(module).__name__}", w.shape[dim], tp.size)
        spec = ShardSpec(dim, w.shape[dim], tp.size, tp.rank)
        weight = _mark(nn.Parameter(spec.take(w.detach()), w.requires_grad), spec)
        bias = _mark(b, None) if b is not None else None
        return cls(weight, bias, tp, transposed=tr, input_is_parallel=input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp)
        y = reduce_from_tp(self._matmul(x, None), self.tp)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, input_is_parallel={self.input_is_parallel}"


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over TP ranks (vocabulary padded to a multiple of the degree).

    Each rank looks up the ids in its row range, zeroes the others, and an all-reduce (g) sums
    the partial embeddings: exactly one rank contributes each row, so the sum is exact.
    """

    def __init__(self, weight: nn.Parameter, tp: Comm, num_embeddings: int, padding_idx: int | None = None):
        super().__init__()
        self.tp, self.num_embeddings, self.padding_idx = tp, num_embeddings, padding_idx
        self.weight = weight
        self.vocab_start = tp.rank * weight.shape[0]

    @classmethod
    def from_module(cls, emb: nn.Embedding, tp: Comm) -> VocabParallelEmbedding:
        spec = ShardSpec(0, emb.num_embeddings, tp.size, tp.rank)
        weight = _mark(nn.Parameter(spec.take(emb.weight.detach()), emb.weight.requires_grad), spec)
        return cls(weight, tp, emb.num_embeddings, emb.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        pidx = None
        if self.padding_idx is not None and 0 <= self.padding_idx - self.vocab_start < self.weight.shape[0]:
            pidx = self.padding_idx - self.vocab_start
        y = F.embedding(local.masked_fill(outside, 0), self.weight, pidx)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(y, self.tp)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, local_rows={self.weight.shape[0]}, tp={self.tp.size}"


def vocab_head_sharing(emb: VocabParallelEmbedding, head: nn.Module, tp: Comm) -> ColumnParallelLinear:
    """A gathered-output vocabulary head that shares (ties) the vocab-parallel embedding weight."""
    bias = getattr(head, "bias", None)
    if bias is not None:
        raise ValueError("a tied vocabulary head with a bias is not supported")
    return ColumnParallelLinear(emb.weight, None, tp, out_features=emb.num_embeddings, gather_output=True)


def full_shape(spec: ShardSpec | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the stored tensor a local parameter of ``shape`` is cut from."""
    if spec is None:
        return shape
    return (*shape[:spec.dim], spec.full, *shape[spec.dim + 1:])


def read_tp_slice(files, key: str, spec: ShardSpec, shape: tuple[int, ...], start: int, end: int,
                  out: torch.Tensor) -> torch.Tensor:
    """This rank's slice of stored tensor ``key`` (local ``shape``) into the flat ``out``.

    ``files`` is anything with ``read(key, start, end, out)`` (the one safetensors reader or a
    folder of them). Each piece is one contiguous element range per index of the dimensions
    before ``spec.dim`` (a single range for dim 0, one per row for the last dim of a matrix), so
    a rank reads only its part; positions of vocabulary padding are zero.
    """
    numel = math.prod(shape)
    if (start, end) != (0, numel):
        raise NotImplementedError(f"{key}: a tensor-parallel slice is streamed whole, not [{start}, {end})")
    if sum(b - a for a, b, _ in spec.pieces()) < shape[spec.dim]:
        out.zero_()  # vocabulary padding
    outer, inner = math.prod(shape[:spec.dim]), math.prod(shape[spec.dim + 1:])
    view = out.view(outer, shape[spec.dim], inner)
    for a, b, d in spec.pieces():
        for o in range(outer):
            first = (o * spec.full + a) * inner
            files.read(key, first, first + (b - a) * inner, view[o, d:d + b - a].reshape(-1))
    return out
