"""DeepSpeed's ``Lamb`` and ``Muon`` config optimizers, with DeepSpeed 0.19's semantics, in plain torch.

Both look at whole tensors (a per-tensor trust ratio; a matrix orthogonalization), so shardwise
steps them on whole parameters (``zero/whole_tensor.py``), never on flat shards.

``Lamb`` is DeepSpeed's ``FusedLamb`` (``deepspeed/ops/lamb``, CUDA kernel ``csrc/lamb``) for one
tensor: Adam moments ``m, v`` without bias correction inside; ``u = m / (sqrt(v) + eps) + wd * w``
(``eps_inside_sqrt``: ``sqrt(v + eps)``); trust ratio ``c = ||w|| / ||u||`` clamped to
``[min_coeff, max_coeff]`` (1 when either norm is 0); ``w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * c * u``
(plain ``lr`` without ``bias_correction``). Defaults as FusedLamb's: lr 1e-3, betas (0.9, 0.999),
eps 1e-8, weight_decay 0, max_coeff 10, min_coeff 0.01.

``Muon`` is DeepSpeed's ``MuonWithAuxAdam`` as ``initialize`` builds it: parameters with ``ndim >= 2``
whose name contains neither "embed" nor "lm_head" get Muon (lr ``muon_lr`` or ``lr``, default 0.02;
momentum 0.95; Nesterov; Newton-Schulz ``ns_method`` "gram" (default) or "standard"; the update scaled
by ``sqrt(max(1, rows / cols))``), the others an Adam (lr ``adam_lr`` or ``lr``, default 3e-4; betas
(0.9, 0.95); eps 1e-10); ``weight_decay`` (default 0) is decoupled in both. As DeepSpeed, the
orthogonalization runs in bf16 ("standard") or fp16 ("gram").
"""

from __future__ import annotations

import math
from typing import Any

import torch

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic Newton-Schulz coefficients DeepSpeed and torch use


def closure_loss(closure: Any) -> Any:
    """The loss of ``closure`` re-evaluated with grad on (torch's step contract), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Lamb(torch.optim.Optimizer):
    """DeepSpeed's FusedLamb update, per tensor (see the module docstring for the formula)."""

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        b1, b2 = group["betas"]
        m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
        state["step"] += 1
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v + group["eps"]).sqrt() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
        update = (m / denom).add_(p, alpha=group["weight_decay"])
        w_norm, u_norm = float(p.norm()), float(update.norm())
        coeff = 1.0
        if w_norm != 0 and u_norm != 0:
            coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
        step_size = group["lr"]
        if group["bias_correction"]:
            t = state["step"]
            step_size = group["lr"] * math.sqrt(1 - b2**t) / (1 - b1**t)
        p.add_(update, alpha=-step_size * coeff)


def _normalized(g: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """``g`` in ``dtype``, wide (rows <= cols), scaled to spectral norm <= 1; whether it was transposed."""
    x, tall = g.to(dtype), g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    return x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7), tall


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalization, in bf16 (DeepSpeed's "standard")."""
    a, b, c = NS_COEFFS
    x, tall = _normalized(g, dtype)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if tall else x


def gram_newton_schulz(g: torch.Tensor, steps: int = 5, restart: int = 2,
                       dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The same iteration run on the small Gram matrix ``R = X X^T`` (DeepSpeed's "gram", fp16).

    The polynomial in ``R`` is accumulated in ``Q`` and applied to ``X`` once at the end, with one
    restart (``X <- Q X``, ``R`` recomputed) at iteration ``restart`` to keep fp16 stable."""
    a, b, c = NS_COEFFS
    x, tall = _normalized(g, dtype)
    if x.size(-1) <= x.size(-2):  # square: no gain, the standard iteration (in fp16)
        for _ in range(steps):
            s = x @ x.mT
            x = a * x + (b * s + c * s @ s) @ x
        return x.mT if tall else x
    r, q = x @ x.mT, None
    for i in range(steps):
        if i == restart and i != 0:
            x, q = q @ x, None
            r = x @ x.mT
        z = b * r + c * r @ r
        q = z + a * torch.eye(z.size(-1), dtype=z.dtype, device=z.device) if q is None else a * q + z @ q
        if i < steps - 1 and i + 1 != restart:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    x = q @ x
    return x.mT if tall else x


class MuonWithAuxAdam(torch.optim.Optimizer):
    """DeepSpeed's hybrid: Muon on groups with ``use_muon=True``, Adam on the others (per tensor)."""

    def __init__(self, param_groups: list[dict]):
        for group in param_groups:
            if "use_muon" not in group:
                raise ValueError("MuonWithAuxAdam: every param group needs use_muon=True or False")
            if group["use_muon"]:
                group.setdefault("lr", 0.02)
                group.setdefault("momentum", 0.95)
                group.setdefault("weight_decay", 0.0)
                group.setdefault("ns_method", "gram")
                if group["ns_method"] not in ("gram", "standard"):
                    raise ValueError(f"optimizer.params.ns_method must be 'gram' or 'standard', got "
                                     f"{group['ns_method']!r}")
            else:
                group.setdefault("lr", 3e-4)
                group.setdefault("betas", (0.9, 0.95))
                group.setdefault("eps", 1e-10)
                group.setdefault("weight_decay", 0.0)
        super().__init__(param_groups, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = self._muon(p, group) if group["use_muon"] else self._adam(p, group)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.reshape(p.shape), alpha=-group["lr"])
        return loss

    def _muon(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        grad, buf, beta = p.grad, state["momentum_buffer"], group["momentum"]
        buf.lerp_(grad, 1 - beta)
        nesterov = grad.lerp(buf, beta)
        mat = nesterov.view(len(nesterov), -1) if nesterov.ndim == 4 else nesterov  # conv filters
        ortho = gram_newton_schulz(mat) if group["ns_method"] == "gram" else newton_schulz(mat)
        return ortho.to(grad.dtype) * max(1.0, grad.size(-2) / grad.size(-1)) ** 0.5

    def _adam(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        state = self.state[p]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] += 1
        b1, b2 = group["betas"]
        state["exp_avg"].lerp_(p.grad, 1 - b1)
        state["exp_avg_sq"].lerp_(p.grad.square(), 1 - b2)
        m_hat = state["exp_avg"] / (1 - b1 ** state["step"])
        v_hat = state["exp_avg_sq"] / (1 - b2 ** state["step"])
        return m_hat / (v_hat.sqrt() + group["eps"])


def uses_muon(name: str, p: torch.Tensor) -> bool:
    """DeepSpeed's rule (``set_optimizer_flags``): a 2-D or larger hidden matrix, not an embedding or head."""
    return p.ndim >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


_MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
MUON_CONFIG_KEYS = (*_MUON_KEYS, "muon_lr", "adam_lr", "betas", "eps")


def muon_param_groups(groups: list[dict], params: dict) -> list[dict]:
    """Each group split into its Muon and Adam tensors (both kept, maybe empty, so every rank has the
    same groups), with the config's keys as DeepSpeed routes them (``muon_lr`` / ``adam_lr`` win over ``lr``)."""
    given = {k: v for k, v in params.items() if v is not None}
    muon = {k: given[k] for k in _MUON_KEYS if k in given}
    adam = {k: (tuple(given[k]) if k == "betas" else given[k]) for k in _ADAM_KEYS if k in given}
    if "muon_lr" in given:
        muon["lr"] = given["muon_lr"]
    if "adam_lr" in given:
        adam["lr"] = given["adam_lr"]
    out = []
    for g in groups:
        extra = {k: v for k, v in g.items() if k != "params"}
        named = [(getattr(p, "shardwise_name", ""), p) for p in g["params"]]
        out.append({**extra, **muon, "use_muon": True, "params": [p for n, p in named if uses_muon(n, p)]})
        out.append({**extra, **adam, "use_muon": False, "params": [p for n, p in named if not uses_muon(n, p)]})
    return out
