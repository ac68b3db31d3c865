"""Which HF MoE layouts expert parallelism knows, per model family (``config.model_type``).

transformers 5 stores a MoE block's experts as two 3-D parameters behind
``@use_experts_implementation``: ``gate_up_proj [E, 2I, H]`` (gate and up concatenated) and
``down_proj [E, H, I]``, no bias, not transposed. Every family listed here was checked to build
exactly that (see ``tests/test_moe.py``); the router, its top-k, its normalization and its aux loss
stay the model's own, so a family is only a name for "its experts look like this". DeepSpeed's
AutoEP ``preset_model`` names map onto the same families.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardwise.cli_errors import UserError

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # sliced on dim 0 (the expert index)

# model_type -> the config attribute holding the number of routed experts
FAMILIES: dict[str, str] = {
    "mixtral": "num_local_experts",
    "qwen3_moe": "num_experts",
    "qwen2_moe": "num_experts",
    "olmoe": "num_experts",
    "deepseek_v2": "n_routed_experts",
    "deepseek_v3": "n_routed_experts",
}

# DeepSpeed AutoEP's preset_model names -> the model types they cover here
PRESETS: dict[str, tuple[str, ...]] = {
    "mixtral": ("mixtral",),
    "qwen3_moe": ("qwen3_moe", "qwen2_moe"),
    "deepseek_v2": ("deepseek_v2",),
    "deepseek_v3": ("deepseek_v3",),
    "olmoe": ("olmoe",),
}


class UnsupportedMoEError(UserError):
    """The model has no MoE layout expert parallelism knows (message: one line, naming it)."""


@dataclass(frozen=True)
class ExpertLayout:
    model_type: str
    num_experts: int
    modules: tuple[tuple[str, nn.Module], ...]  # (qualified name, experts module) per MoE layer


def _is_standard(module: nn.Module) -> bool:
    return (getattr(module, "has_gate", False) and not module.has_bias and not module.is_transposed
            and not module.has_post_expert_norm and all(isinstance(getattr(module, n, None), nn.Parameter)
                                                        and getattr(module, n).dim() == 3 for n in EXPERT_PARAMS))


def expert_layout(model: nn.Module, preset: str | None = None) -> ExpertLayout:
    """The model's experts modules, checked against its family (and ``preset`` when given)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None) or type(model).__name__
    if preset is not None:
        if preset not in PRESETS:
            raise UnsupportedMoEError(f"expert_parallel.preset_model {preset!r} is not known; known: "
                                      f"{', '.join(sorted(PRESETS))}")
        if model_type not in PRESETS[preset]:
            raise UnsupportedMoEError(f"expert_parallel.preset_model {preset!r} does not match the model "
                                      f"(model_type {model_type!r})")
    if model_type not in FAMILIES:
        raise UnsupportedMoEError(f"expert parallelism: no known MoE layout for model_type {model_type!r} "
                                  f"(supported: {', '.join(sorted(FAMILIES))})")
    num = int(getattr(config, FAMILIES[model_type]))
    mods = tuple((n, m) for n, m in model.named_modules() if hasattr(m, "has_gate") and hasattr(m, "gate_up_proj"))
    if not mods:
        raise UnsupportedMoEError(f"expert parallelism: model_type {model_type!r} has no experts module "
                                  "(@use_experts_implementation with gate_up_proj / down_proj)")
    for name, m in mods:
        if not _is_standard(m) or m.gate_up_proj.shape[0] != num:
            raise UnsupportedMoEError(f"expert parallelism: {name} ({type(m).__name__}) is not the "
                                      f"[E={num}, 2I, H] / [E, H, I] layout without bias this version supports")
    return ExpertLayout(model_type, num, mods)
