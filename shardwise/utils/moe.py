"""DeepSpeed's ``deepspeed.moe.utils`` helpers for building optimizer param groups.

Scripts written for DeepSpeed pass their parameters through
``split_params_into_different_moe_groups_for_optimizer`` (or ``configure_moe_param_groups``)
whether or not the model has experts; DeepSpeed's own checkpoint tests do it for every model. For a
model without expert parameters both return the groups unchanged, which is what DeepSpeed returns
too. shardwise's expert parallelism splits the experts of Hugging Face MoE models
(``shardwise.moe``, DeepSpeed's AutoEP keys; docs/moe.md), not DeepSpeed's own MoE layers: a
parameter such a layer marked as an expert's (``param.allreduce = False``, meaning "reduce over the
expert group, not all ranks") has no expert group here and would be reduced over every
data-parallel rank, a different gradient, so it is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter an MoE layer marked as an expert's (``allreduce = False``)."""
    return getattr(param, "allreduce", True) is False


def _as_group_list(param_groups: Any) -> list[dict[str, Any]]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)) and all(isinstance(g, dict) for g in param_groups):
        return list(param_groups)
    raise ValueError(f"param groups must be a dict or a list/tuple of dicts, not {type(param_groups).__name__}")


def _refuse_experts(groups: list[dict[str, Any]]) -> None:
    for gi, group in enumerate(groups):
        for param in group["params"]:
            if is_moe_param(param):
                raise NotImplementedError(
                    f"param group {gi} ({group.get('name', 'unnamed')}) holds an expert parameter "
                    f"(allreduce=False, expert group {getattr(param, 'group_name', '?')!r}): the expert "
                    "groups of DeepSpeed's MoE layers are not implemented in shardwise (its expert parallelism "
                    "serves Hugging Face MoE models: docs/moe.md), and reducing it over every rank would "
                    "train a different model; remove the MoE layer or use DeepSpeed for it")


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict[str, Any] | list[dict[str, Any]] | tuple[dict[str, Any], ...],
        max_group_size: int | float | None = 178956971) -> list[dict[str, Any]]:
    """The groups as a list, each ``params`` as a list; expert parameters are refused (see module doc).

    ``max_group_size`` only splits expert groups in DeepSpeed, so it has nothing to act on here.
    """
    groups = _as_group_list(param_groups)
    for group in groups:
        group["params"] = list(group["params"])
    _refuse_experts(groups)
    return groups


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """``model_parameters`` (parameters or group dicts) as optimizer param groups, as DeepSpeed builds them."""
    if not isinstance(model_parameters, list) or not model_parameters:
        raise ValueError("model_parameters must be a non-empty list of parameters or param-group dicts")
    if not all(isinstance(p, (torch.Tensor, dict)) for p in model_parameters):
        raise TypeError("each entry given to the optimizer must be a Tensor or a param-group dict")
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"})
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
