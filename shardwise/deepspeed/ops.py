"""``deepspeed.ops``: DeepSpeed's optimizer kernels as torch optimizers with the same math.

DeepSpeed ships C++/CUDA builds of Adam, Adagrad and Lion (``DeepSpeedCPUAdam`` for offload,
``FusedAdam`` on the device). Accelerate swaps a user's torch optimizer for ``DeepSpeedCPUAdam``
when the optimizer is offloaded, and DeepSpeed configs name them. shardwise steps optimizers on
the fp32 master shards wherever they live, so these are torch's own algorithms under DeepSpeed's
class names and constructor signatures; an option with no torch equivalent is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from shardwise.optim.ds_optimizers import closure_loss


def _refuse(cls: str, option: str, why: str) -> None:
    raise NotImplementedError(f"deepspeed.ops {cls}({option}): {why}; shardwise's facade runs torch's algorithm")


class DeepSpeedCPUAdam(torch.optim.Adam):
    """Adam (``adamw_mode=True``: AdamW's decoupled weight decay), DeepSpeed's CPU kernel's math."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):  # noqa: ARG002
        if not bias_correction:
            _refuse(type(self).__name__, "bias_correction=False", "torch's Adam always corrects the bias")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adamw_mode)


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's fused device Adam (``adam_w_mode=True``: decoupled weight decay)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):  # noqa: ARG002
        if not bias_correction:
            _refuse(type(self).__name__, "bias_correction=False", "torch's Adam always corrects the bias")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode)


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """Adagrad with DeepSpeed's CPU kernel's signature."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True):  # noqa: ARG002
        if amsgrad:
            _refuse(type(self).__name__, "amsgrad=True", "Adagrad has no amsgrad variant")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


class DeepSpeedCPULion(Optimizer):
    """Lion (Chen et al. 2023), as DeepSpeed's kernel computes it: with ``c = b1 m + (1 - b1) g``,
    ``p <- p (1 - lr wd) - lr sign(c)``, then ``m <- b2 m + (1 - b2) g``. torch has no Lion."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, fp32_optimizer_states: bool = True):  # noqa: ARG002
        super().__init__(model_params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


FusedLion = DeepSpeedCPULion


class OpBuilder:
    """``deepspeed.ops.op_builder.*Builder``: what a builder's ``NAME`` keys in ``__compatible_ops__``."""

    NAME = "op"

    def is_compatible(self, verbose: bool = False) -> bool:  # noqa: ARG002
        return COMPATIBLE_OPS[self.NAME]


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"


class FusedAdamBuilder(OpBuilder):
    NAME = "fused_adam"


class CompatibleOps(dict):
    """``deepspeed.ops.__compatible_ops__``: the ops whose job torch does here (Adam on the host and
    on the device); every other DeepSpeed kernel is reported absent (False)."""

    def __missing__(self, key: str) -> bool:
        return False


COMPATIBLE_OPS = CompatibleOps({CPUAdamBuilder.NAME: True, FusedAdamBuilder.NAME: True})
