"""Optimizers named in DeepSpeed configs (the LR schedules are ``schedules.py``).

The engine steps torch optimizers over sharded fp32 master tensors, so everything here builds plain
``torch.optim`` objects; the only DeepSpeed-specific parts are the config semantics (``Adam`` means
AdamW unless ``adam_w_mode`` is false).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import SGD, Adam, AdamW, Optimizer

from shardwise.config.schema import OPTIMIZERS as CONFIG_OPTIMIZERS
from shardwise.optim.ds_optimizers import MUON_CONFIG_KEYS, Lamb, MuonWithAuxAdam, muon_param_groups

__all__ = [
    "build_optimizer",
    "rebuild_client_optimizer",
    "client_param_groups",
    "reject_unknown",
]

# The names come from the config schema (the one list of what the config accepts).
_SUPPORTED_OPTIMIZERS = tuple(name for name, _ in CONFIG_OPTIMIZERS.values())


def _accepted_kwargs(cls: type) -> set[str]:
    """Constructor keywords of an optimizer/scheduler class, minus the positional inputs."""
    names = set(inspect.signature(cls.__init__).parameters)
    return names - {"self", "params", "optimizer"}


def reject_unknown(section: str, given: dict, cls: type) -> None:
    """Name the first config key the target class would reject with a bare TypeError."""
    accepted = _accepted_kwargs(cls)
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise ValueError(
            f"{section}.{unknown[0]} is not a {cls.__name__} parameter "
            f"(accepted: {', '.join(sorted(accepted))})"
        )


def _kernel_kwargs(groups: list[dict], fused: bool | None, foreach: bool | None) -> dict[str, bool]:
    """Pick torch's multi-tensor kernel.

    Measured on this repo's 2-core CPU box (torch 2.13, 10 fp32 tensors of 1M elements, ms per
    step): AdamW foreach 27.0 / fused 4.1 / per-tensor 29.0; Adam 25.9 / 4.4 / 27.1; SGD with
    momentum 4.5 / 2.8 / 4.7. Fused wins everywhere, so it is the default on CPU and CUDA;
    foreach is the fallback for other devices (meta, mps, ...) and non-float tensors.
    """
    if fused is not None:
        return {"fused": True} if fused else {"foreach": True if foreach is None else foreach}
    if foreach is not None:
        return {"foreach": foreach}
    tensors = [p for g in groups for p in g["params"]]
    ok = bool(tensors) and all(
        p.device.type in ("cpu", "cuda")
        and p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        for p in tensors
    )
    return {"fused": True} if ok else {"foreach": True}


def build_optimizer(opt_type: str, params: dict, param_groups: list[dict]) -> Optimizer:
    """Build the torch optimizer a DeepSpeed ``optimizer`` config section describes.

    DeepSpeed's ``Adam`` defaults to ``adam_w_mode=true`` (decoupled decay, i.e. AdamW) and its
    fused Adam defaults ``weight_decay`` to 0, unlike ``torch.optim.AdamW`` (0.01); both are kept.
    ``torch_adam=true`` in DeepSpeed means "use torch's class with torch's defaults", also kept.
    """
    name = opt_type.lower()
    kw: dict[str, Any] = dict(params)
    torch_adam = bool(kw.pop("torch_adam", False))
    adam_w_mode = bool(kw.pop("adam_w_mode", True))
    fused = kw.pop("fused", None)
    foreach = kw.pop("foreach", None)
    cls: type[Optimizer]
    if name in ("adam", "adamw"):
        if not kw.pop("bias_correction", True):
            raise ValueError(
                "optimizer.params.bias_correction=false is not supported (torch Adam always corrects)"
            )
        cls = AdamW if (name == "adamw" or adam_w_mode) else Adam
        if not torch_adam:
            kw.setdefault("weight_decay", 0.0)
        if "betas" in kw:
            kw["betas"] = tuple(kw["betas"])
    elif name == "sgd":
        cls = SGD
    elif name in ("lamb", "muon"):
        return _build_whole_tensor_optimizer(name, kw, param_groups)
    else:
        raise ValueError(
            f"optimizer.type {opt_type!r} is not supported; supported: {', '.join(_SUPPORTED_OPTIMIZERS)}"
        )
    reject_unknown("optimizer.params", kw, cls)
    kw.update(_kernel_kwargs(param_groups, fused, foreach))
    return cls(param_groups, **kw)


def config_optimizer_class(opt_type: str) -> type[Optimizer]:
    """The class ``build_optimizer`` makes for a config ``optimizer.type`` (tells flat from whole-tensor)."""
    return {"lamb": Lamb, "muon": MuonWithAuxAdam, "sgd": SGD, "adam": Adam}.get(opt_type.lower(), AdamW)


def _build_whole_tensor_optimizer(name: str, kw: dict[str, Any], param_groups: list[dict]) -> Optimizer:
    """DeepSpeed's Lamb (FusedLamb) or Muon (MuonWithAuxAdam) over whole tensors (ds_optimizers.py)."""
    if name == "muon":
        unknown = sorted(set(kw) - set(MUON_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"optimizer.params.{unknown[0]} is not a Muon parameter "
                             f"(accepted: {', '.join(sorted(MUON_CONFIG_KEYS))})")
        return MuonWithAuxAdam(muon_param_groups(param_groups, kw))
    if kw.pop("amsgrad", False):
        raise ValueError("optimizer.params.amsgrad=true: DeepSpeed's Lamb does not support AMSGrad")
    if kw.pop("max_grad_norm", 0.0):
        raise ValueError("optimizer.params.max_grad_norm: Lamb's own clipping is not implemented; use "
                         "gradient_clipping, which clips the same global norm before the step")
    reject_unknown("optimizer.params", kw, Lamb)
    return Lamb(param_groups, **kw)


def normalize_param_groups(model: nn.Module, model_parameters: Iterable | None) -> list[dict]:
    """DeepSpeed's ``model_parameters``: None, an iterable of tensors, or of group dicts."""
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g) for g in items]
        for g in groups:
            g["params"] = list(g["params"])
        return groups
    if items and isinstance(items[0], tuple):  # named_parameters()
        items = [p for _, p in items]
    return [{"params": items}]


def client_param_groups(model: torch.nn.Module, model_parameters: Any, client: Any) -> list[dict]:
    """The optimizer param groups the engine builds its shards for, as DeepSpeed picks them.

    A client optimizer *instance* defines them itself (``model_parameters`` only matters to a
    config optimizer or a factory). Groups without parameters are dropped, as DeepSpeed drops
    them from the optimizer it returns.
    """
    if isinstance(client, Optimizer):
        groups = [{**g, "params": list(g["params"])} for g in client.param_groups]
    else:
        groups = normalize_param_groups(model, model_parameters)
    kept = [g for g in groups if g["params"]]
    if not kept:
        raise ValueError("the optimizer has no parameters: every param group given "
                         "(optimizer= or model_parameters=) is empty")
    return kept


def rebuild_client_optimizer(
    client: Optimizer | Callable[[list], Optimizer], new_param_groups: list[list[torch.Tensor]] | list[dict]
) -> Optimizer:
    """Point a user's optimizer at the engine's master tensors; returns the optimizer to step.

    The user built ``client`` over the model's parameters; the engine steps sharded fp32 masters
    instead. As DeepSpeed's ZeRO optimizers do, the client object itself is kept and each of its
    non-empty param groups gets the engine's tensors (group ``i`` -> ``new_param_groups[i]``), so
    ``initialize`` returns the very object the user passed, with its class, hyperparameters and any
    scheduler built on it intact. Empty groups are removed from it, as DeepSpeed removes them.
    State cannot be carried over (it is keyed by the old tensors and unsharded), so a stepped
    optimizer is refused. A callable (DeepSpeed's ``optimizer=lambda params: ...``) is called with
    the group dicts (hyperparameters of ``model_parameters`` groups included).
    """
    groups = [g if isinstance(g, dict) else {"params": list(g)} for g in new_param_groups]
    if isinstance(client, Optimizer):
        if any(len(s) for s in client.state.values()):
            raise ValueError(
                f"the {type(client).__name__} passed as optimizer= already has state (it was stepped "
                "or loaded); pass a freshly constructed optimizer and load its state through the engine"
            )
        client.param_groups[:] = [pg for pg in client.param_groups if len(pg["params"])]
        if len(client.param_groups) != len(groups):
            raise ValueError(
                f"client optimizer has {len(client.param_groups)} param groups but the engine built "
                f"{len(groups)}"
            )
        for pg, new in zip(client.param_groups, groups, strict=True):
            pg["params"] = list(new["params"])
        client.state.clear()
        return client
    if callable(client):
        opt = client([{**g, "params": list(g["params"])} for g in groups])
        if not isinstance(opt, Optimizer):
            raise TypeError(
                f"optimizer callable returned {type(opt).__name__}, expected torch.optim.Optimizer"
            )
        return opt
    raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(client).__name__}")
