"""ALST's memory pieces: the MLP and the LM head + loss computed over sequence tiles.

Both are autograd functions that keep only their input: the forward runs tile by tile under
``no_grad`` and the backward recomputes each tile (the MLP with gradients and
``torch.autograd.grad``; the loss's softmax gradient written by hand into the tile's one logits
buffer). What they save, per layer, for ``s`` tokens of hidden size ``h``, vocab ``V`` and MLP
width ``m``: the MLP's intermediate activations (about ``3 s m`` values) become the input alone (``s h``)
plus one tile's intermediates while it runs; the ``[s, V]`` logits (and their fp32 copy for the
loss) are never whole, one tile's are. The cost: each tile's forward runs twice (once more in
backward), as in activation checkpointing.

Parameters are inputs of the functions, so their gradients, summed over the tiles, reach autograd
once (ZeRO's gradient hooks fire once per backward, as for an untiled layer) and are multiplied by
the incoming gradient: a scale applied to the loss (``loss / n``, fp16 loss scaling, 1/accumulation)
reaches the LM head's gradient. DeepSpeed's ``TiledFusedLogitsLoss`` runs the head's backward
inside its forward and loses such a scale. Results equal the untiled computation up to fp32
round-off: the same per-token operations, with matmuls of other shapes and the parameter
gradients summed tile by tile (tests/test_sequence_parallel.py measures ~1e-7 relative); the loss's
softmax as ``exp(z - max) / sum`` rather than ``exp(log_softmax)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.sequence_parallel.data import IGNORE


def tile_count(seq: int, hidden: int, tiles: int | str) -> int:
    """``"auto"``: ALST's choice, one tile per ``hidden`` tokens (a tile's intermediates ~ its input's size)."""
    n = max(1, math.ceil(seq / hidden)) if tiles == "auto" else int(tiles)
    if n < 1:
        raise ValueError(f"tiles must be >= 1 or 'auto', got {tiles!r}")
    return min(n, max(seq, 1))


def _add(acc: list, grads: tuple) -> None:
    for i, g in enumerate(grads):
        if g is not None:
            acc[i] = g if acc[i] is None else acc[i] + g


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable, tiles: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.fn, ctx.tiles, ctx.params = fn, tiles, params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(t) for t in x.tensor_split(tiles, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        grads_x, grads_p = [], [None] * len(ctx.params)
        for xt, gt in zip(x.tensor_split(ctx.tiles, dim=-2), grad.tensor_split(ctx.tiles, dim=-2), strict=True):
            xt = xt.detach().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                out = ctx.fn(xt)
            inputs = ((xt,) if x.requires_grad else ()) + tuple(ctx.params)
            got = torch.autograd.grad(out, inputs, gt, allow_unused=True)
            if x.requires_grad:
                grads_x.append(got[0])
                got = got[1:]
            _add(grads_p, got)
        gx = torch.cat(grads_x, dim=-2) if x.requires_grad else None
        return (None, None, gx, *grads_p)


def tiled_mlp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: list[torch.Tensor],
              tiles: int | str = "auto") -> torch.Tensor:
    """``fn(x)`` for a per-token ``fn`` of ``x`` [batch, seq, hidden] (or [seq, hidden]), over sequence
    tiles, recomputed in backward; ``params``: the parameters ``fn`` uses (their gradients are returned
    through autograd)."""
    n = tile_count(x.shape[-2], x.shape[-1], tiles)
    trainable = [p for p in params if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or trainable):
        return fn(x)
    return _TiledMLP.apply(fn, n, x, *trainable)


def tile_mlps(model: nn.Module, tiles: int | str = "auto") -> int:
    """Make every ``mlp`` submodule of ``model`` (HF decoder layers: ``layers[i].mlp``) a tiled MLP.

    The module keeps its parameters and state dict; only its forward changes. Returns how many."""
    count = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "mlp" or "forward" in module.__dict__:
            continue
        plain = type(module).forward

        def forward(x: torch.Tensor, _m: nn.Module = module, _plain: Callable = plain) -> torch.Tensor:
            return tiled_mlp(lambda t: _plain(_m, t), x, list(_m.parameters()), tiles)

        module.forward = forward
        count += 1
    if count == 0:
        raise ValueError(f"tile_mlps: {type(model).__name__} has no submodule named 'mlp'")
    return count


def _rows(h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile as rows: hidden [n, h], the label of each row made a valid index, and which rows count."""
    lab = labels.reshape(-1)
    valid = lab != IGNORE
    return h.reshape(-1, h.shape[-1]), torch.where(valid, lab, torch.zeros_like(lab)), valid


def _exp_logits(h2: torch.Tensor, safe: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tile's fp32 logits turned, in place, into ``exp(logits - max)``: the one ``[n, V]`` buffer the
    tile needs, for the loss and for its gradient. Returns it, the row sums and the loss of each row."""
    z = F.linear(h2, weight, bias).float()
    target = z.gather(1, safe.unsqueeze(1)).squeeze(1)
    top = z.amax(1, keepdim=True)
    z.sub_(top).exp_()
    total = z.sum(1)
    return z, total, top.squeeze(1) + total.log() - target


class _TiledLoss(torch.autograd.Function):
    """Summed cross entropy over sequence tiles, the softmax gradient written by hand.

    Why by hand: autograd's cross entropy holds a tile's logits, log-softmax and their gradients
    (four ``[n, V]`` buffers) and hands back each tile's head gradient as a new tensor; here one
    ``[n, V]`` buffer is the logits, then their softmax, then their gradient (in place), and each
    tile's head gradient is added in place into one buffer (``addmm_``), handed to autograd once,
    multiplied by the incoming gradient (so a scale on the loss reaches it)."""

    @staticmethod
    def forward(ctx, tiles: int, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,  # noqa: ANN001
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.tiles, ctx.weight, ctx.bias = tiles, weight, bias
        ctx.save_for_backward(hidden, labels)
        parts = []
        for h, lab in zip(hidden.tensor_split(tiles, 1), labels.tensor_split(tiles, 1), strict=True):
            h2, safe, valid = _rows(h, lab)
            _, _, row_loss = _exp_logits(h2, safe, weight, bias)
            parts.append(torch.where(valid, row_loss, torch.zeros_like(row_loss)).sum())
        return torch.stack(parts).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        hidden, labels = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        gh = torch.empty_like(hidden) if ctx.needs_input_grad[1] else None
        gw = torch.zeros_like(weight) if ctx.needs_input_grad[3] else None
        gb = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[4] else None
        start = 0
        for h, lab in zip(hidden.tensor_split(ctx.tiles, 1), labels.tensor_split(ctx.tiles, 1), strict=True):
            h2, safe, valid = _rows(h, lab)
            z, total, _ = _exp_logits(h2, safe, weight, bias)
            z.div_(total.unsqueeze(1))  # softmax
            z.scatter_add_(1, safe.unsqueeze(1), torch.full_like(total, -1.0).unsqueeze(1))
            z.mul_(torch.where(valid, grad.float(), torch.zeros_like(total)).unsqueeze(1))  # d loss / d logits
            gz = z.to(weight.dtype)  # z itself in fp32
            del z
            if gh is not None:
                gh[:, start:start + h.shape[1]] = (gz @ weight).view_as(h)
            if gw is not None:
                gw.addmm_(gz.t(), h2.to(weight.dtype))
            if gb is not None:
                gb.add_(gz.sum(0))
            start += h.shape[1]
            del gz  # before the next tile's buffer exists: one [n, V] at a time
        return None, gh, None, gw, gb


def tiled_loss_sum(hidden: torch.Tensor, head: nn.Linear, shift_labels: torch.Tensor,
                   tiles: int | str = "auto") -> torch.Tensor:
    """Summed cross entropy of ``head(hidden)`` against ``shift_labels`` (-100 ignored), over sequence
    tiles: the ``[batch, seq, vocab]`` logits never exist whole. Differentiable in ``hidden`` and ``head``."""
    n = tile_count(hidden.shape[1], hidden.shape[-1], tiles)  # "auto": a tile's logits ~ hidden x vocab
    return _TiledLoss.apply(n, hidden, shift_labels, head.weight, head.bias)


class _LossHead:
    """While installed, the model's output embedding returns the summed loss in place of logits.

    Why inside the forward: at ZeRO-3 the head's weight is gathered only while the model's root
    runs, and the root's backward gather is triggered by its outputs; returning the loss as the
    ``logits`` output keeps both true without touching the model's code."""

    def __init__(self, head: nn.Linear, shift_labels: torch.Tensor, tiles: int | str):
        self.head, self.labels, self.tiles = head, shift_labels, tiles

    def __enter__(self) -> None:
        head, labels, tiles = self.head, self.labels, self.tiles
        self.head.forward = lambda hidden: tiled_loss_sum(hidden, head, labels, tiles)

    def __exit__(self, *exc: Any) -> None:
        del self.head.forward


def tiled_causal_lm_loss(model: nn.Module, batch: dict[str, Any], shift_labels: torch.Tensor, sp: Any = None,
                         tiles: int | str = "auto") -> torch.Tensor:
    """The causal-LM loss of ``model(**batch)`` (a model, or an engine wrapping it) with tiled logits.

    Without ``sp``: the mean over real target tokens (HF's loss). With ``sp`` (a sequence-split batch):
    ``sequence_parallel_loss``'s value and gradient (every token once over the SP group)."""
    from shardwise.sequence_parallel.loss import share_of_loss, token_count

    inner = getattr(model, "module", model)
    head = inner.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"tiled_causal_lm_loss needs an nn.Linear output embedding, not {type(head).__name__}")
    with _LossHead(head, shift_labels, tiles):
        loss_sum = model(**batch).logits
    if sp is not None:
        return share_of_loss(loss_sum, token_count(shift_labels, sp), sp)
    return loss_sum / (shift_labels != IGNORE).sum().clamp_min(1)


class _TiledReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable, tiles: int, mean: bool, x: torch.Tensor, y: torch.Tensor,  # noqa: ANN001
                mask: torch.Tensor | None, *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.tiles, ctx.mean, ctx.params = fn, tiles, mean, params
        ctx.save_for_backward(x, y, mask)
        with torch.no_grad():
            parts = [fn(*a) for a in _tiles_of(x, y, mask, tiles)]
        out = torch.stack(parts).sum()
        return out / tiles if mean else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        x, y, mask = ctx.saved_tensors
        g = grad / ctx.tiles if ctx.mean else grad  # the incoming gradient: any scale on the output
        grads_x, grads_p = [], [None] * len(ctx.params)
        for xt, *rest in _tiles_of(x, y, mask, ctx.tiles):
            xt = xt.detach().requires_grad_(True)
            with torch.enable_grad():
                part = ctx.fn(xt, *rest)
            got = torch.autograd.grad(part, (xt, *ctx.params), g, allow_unused=True)
            grads_x.append(got[0] if got[0] is not None else torch.zeros_like(xt))
            _add(grads_p, got[1:])
        gx = torch.cat(grads_x).view_as(x) if x.requires_grad else None
        return (None, None, None, gx, None, None, *grads_p)


def _tiles_of(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, tiles: int) -> list[tuple]:
    """Tiles over the flattened [batch * seq] rows (so a tile never strides across samples)."""
    xs = x.reshape(-1, *x.shape[2:]).chunk(tiles)
    ys = y.reshape(-1, *y.shape[2:]).chunk(tiles)
    if mask is None:
        return list(zip(xs, ys, strict=True))
    return list(zip(xs, ys, mask.reshape(-1).chunk(tiles), strict=True))


def tiled_reduce(fn: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
                 tiles: int, params: list[torch.Tensor], reduction: str = "mean") -> torch.Tensor:
    """``fn(x_tile, y_tile[, mask_tile])`` (a scalar per tile) summed, or averaged over tiles, with the
    tiles recomputed in backward: a loss whose per-tile intermediates (logits) never exist together.
    ``params``: the parameters ``fn`` uses. Tiles are ``torch.chunk``s of the flattened rows."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
        raise ValueError("tiled loss: x [batch, seq, ...] and y [batch, seq, ...] must agree in batch and seq")
    tiles = len(x.reshape(-1, *x.shape[2:]).chunk(int(tiles)))  # torch.chunk may make fewer
    trainable = [p for p in params if p.requires_grad]
    return _TiledReduce.apply(fn, tiles, reduction == "mean", x, y, mask, *trainable)
