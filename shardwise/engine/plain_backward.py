"""A plain ``loss.backward()`` on the engine, with DeepSpeed's semantics (``engine.backward`` optional).

DeepSpeed (0.18.3 on) lets a script call ``loss.backward()`` on the engine's output and then
``engine.step()``: the gradients are divided by ``gradient_accumulation_steps`` by the engine's
hooks, and fp16 needs ``engine.scale(loss).backward()`` (a backward without the loss scale is
refused by name). shardwise does the same at every stage. The engine's boundary rule decides
whether the backward reduces (stages 0-1 accumulate locally until the boundary, as under
``engine.backward``), and the 1/gas factor multiplies each parameter's gradient as autograd hands it
over (the tensor hook of ``Sharding``), so it is applied exactly once whatever the loss was computed
from (HF's ``loss`` and ``logits`` are both outputs). With a power-of-two accumulation in fp32 / bf16
the result is bit-identical to ``engine.backward(loss)`` (tested); otherwise it differs from it by
one rounding per gradient element. ``engine.scale(loss).backward()`` multiplies the loss by the
same factor ``engine.backward`` does, so it equals it bit for bit at any accumulation, fp16 included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardwise.engine.checks import track_used
from shardwise.engine.compat import UsageError

if TYPE_CHECKING:
    from shardwise.engine.parts import EngineParts


def scale_loss(engine: EngineParts, loss: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's ``engine.scale(loss)``, for ``engine.scale(loss).backward()``: the loss times 1/gas
    and the fp16 loss scale, exactly the product ``engine.backward`` takes, and the next backward's
    gradient hook then scales nothing. (DeepSpeed leaves 1/gas to its hooks; the result is the same
    up to rounding, and this way it is engine.backward's to the bit: halving fp16 gradients after
    the backward would round the subnormal ones.)"""
    if engine.optimizer is None:
        raise UsageError("must provide optimizer during init in order to use scale")
    if not (torch.is_tensor(loss) and loss.numel() == 1 and loss.grad_fn is not None):
        raise UsageError("engine.scale(loss): loss must be a scalar tensor with grad_fn")
    engine.manual_scale_pending = True
    scale = 1.0 / engine.gas
    if engine.loss_scaler is not None:
        scale *= engine.loss_scaler.scale
    return loss * scale


def plain_backward_rule(engine: EngineParts) -> tuple[bool, float]:
    """Called when a backward the engine did not start reaches the model: (reduce now, gradient factor)."""
    scaled, engine.manual_scale_pending = engine.manual_scale_pending, False
    if engine.optimizer is None:  # evaluation only: no step, so nothing to scale for
        return engine.sharding.requires_sync, 1.0
    if engine.loss_scaler is not None and not scaled:
        raise UsageError("fp16 loss scaling is required for this configuration, but loss.backward() was called "
                         "without scaling the loss: use engine.backward(loss) or engine.scale(loss).backward()")
    track_used(engine)
    reduce_now = engine.is_gradient_accumulation_boundary() and not engine._in_no_sync
    engine._grads_reduced = reduce_now
    return reduce_now, 1.0 if scaled else 1.0 / engine.gas
