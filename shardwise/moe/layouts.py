"""Which HF MoE layouts expert parallelism knows, per model family (``config.model_type``).

transformers 5 stores a MoE block's experts as 3-D parameters behind
``@use_experts_implementation``. Two layouts are served:

- the standard one: ``gate_up_proj [E, 2I, H]`` (gate and up concatenated) and ``down_proj
  [E, H, I]``, no bias, not transposed (``x @ W.T``): Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3;
- GPT-OSS's: transposed (``x @ W``: ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``), with
  per-expert biases ``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, H]``, gate and up
  interleaved (columns ``::2`` / ``1::2``) and read by the module's own clamped ``_apply_gate``.

Every parameter of an experts module is sliced on dim 0 (the expert index), biases included.
Every family listed here was checked to build exactly that (see ``tests/test_moe.py``); the
router, its top-k, its normalization and its aux loss stay the model's own, so a family is only a
name for "its experts look like this". DeepSpeed's AutoEP ``preset_model`` names map onto the same
families (``gpt_oss`` is shardwise's own name).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardwise.errors import UserError

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # sliced on dim 0 (the expert index)
BIAS_PARAMS = ("gate_up_proj_bias", "down_proj_bias")  # [E, 2I], [E, H]: sliced the same way

# model_type -> the config attribute holding the number of routed experts
FAMILIES: dict[str, str] = {
    "mixtral": "num_local_experts",
    "qwen3_moe": "num_experts",
    "qwen2_moe": "num_experts",
    "olmoe": "num_experts",
    "deepseek_v2": "n_routed_experts",
    "deepseek_v3": "n_routed_experts",
    "gpt_oss": "num_local_experts",
}

# DeepSpeed AutoEP's preset_model names -> the model types they cover here
PRESETS: dict[str, tuple[str, ...]] = {
    "mixtral": ("mixtral",),
    "qwen3_moe": ("qwen3_moe", "qwen2_moe"),
    "deepseek_v2": ("deepseek_v2",),
    "deepseek_v3": ("deepseek_v3",),
    "olmoe": ("olmoe",),
    "gpt_oss": ("gpt_oss",),
}


class UnsupportedMoEError(UserError):
    """The model has no MoE layout expert parallelism knows (message: one line, naming it)."""


@dataclass(frozen=True)
class ExpertLayout:
    model_type: str
    num_experts: int
    modules: tuple[tuple[str, nn.Module], ...]  # (qualified name, experts module) per MoE layer


def expert_params(module: nn.Module) -> tuple[str, ...]:
    """The names of an experts module's parameters that EP slices on dim 0 (biases when it has them)."""
    return EXPERT_PARAMS + (BIAS_PARAMS if module.has_bias else ())


def _expected_shapes(module: nn.Module, num: int) -> dict[str, tuple[int, ...]]:
    """The shapes this version serves, from ``down_proj``'s sizes (transposed: ``x @ W``, else ``x @ W.T``)."""
    down = module.down_proj.shape
    inner, hidden = (down[1], down[2]) if module.is_transposed else (down[2], down[1])
    gate_up = (num, hidden, 2 * inner) if module.is_transposed else (num, 2 * inner, hidden)
    shapes = {"gate_up_proj": gate_up, "down_proj": (num, *down[1:])}
    if module.has_bias:
        shapes.update(gate_up_proj_bias=(num, 2 * inner), down_proj_bias=(num, hidden))
    return shapes


def _is_served(module: nn.Module, num: int) -> bool:
    """Gated, no post-expert norm, and every parameter of the expected shape. Transposed or not and
    biased or not are both served; gate/up interleaving is the module's own ``_apply_gate``'s."""
    if not getattr(module, "has_gate", False) or module.has_post_expert_norm:
        return False
    if not isinstance(getattr(module, "down_proj", None), nn.Parameter) or module.down_proj.dim() != 3:
        return False
    return all(isinstance(getattr(module, n, None), nn.Parameter) and tuple(getattr(module, n).shape) == shape
               for n, shape in _expected_shapes(module, num).items())


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
        if not _is_served(m, num):
            raise UnsupportedMoEError(f"expert parallelism: {name} ({type(m).__name__}) is not a layout this "
                                      f"version supports ([E={num}, 2I, H] / [E, H, I] without bias, or "
                                      "transposed with [E, 2I] / [E, H] biases)")
    return ExpertLayout(model_type, num, mods)
