"""``shardwise.init_inference``: shardwise's keywords and DeepSpeed's ``init_inference`` call forms.

DeepSpeed inference scripts call ``deepspeed.init_inference(model, config=None, **kwargs)`` with
``tensor_parallel={"tp_size": n}`` (or the older ``mp_size=n``), ``dtype=torch.half`` and
``replace_with_kernel_inject=True``, then use the result as the model (``pipe.model = engine``) or
its ``.module``. Both work here: the result is the model itself, prepared by
:func:`shardwise.inference.init_inference`, and its ``module`` attribute is the same object.

Every DeepSpeed inference key is placed in one of three sets below. Keys that only choose CUDA
kernels or their workspace do not change the numbers: they are accepted, and the first call names
them once on stderr. Keys whose meaning shardwise does not implement (DeepSpeed's checkpoint
formats, MoE expert groups, its int8 kernels, an external TP group, ZeRO through this call) are
refused when set to anything but their default. An unknown key is refused naming the closest
known one. Unlike DeepSpeed, ``dtype`` defaults to the model's own dtype (DeepSpeed casts to fp16):
more accurate on CPUs, where fp16 has no fast kernels.
"""

from __future__ import annotations

import difflib
import os
import sys
from typing import Any

import torch
from torch import nn

from shardwise.config.read import read_config
from shardwise.config.schema import ConfigError
from shardwise.files.safetensors_io import dtype_from_name

# shardwise's own keywords of init_inference (see shardwise.inference.init_inference)
OWN = ("tensor_parallel_size", "offload", "dtype", "prefetch", "quantize", "group_size", "progress")
# DeepSpeed keys that select kernels, graphs or buffers only: the model computes the same function
KERNEL_ONLY = ("replace_with_kernel_inject", "kernel_inject", "enable_cuda_graph", "use_triton",
               "triton_autotune", "max_out_tokens", "max_tokens", "min_out_tokens", "min_tokens",
               "triangular_masking", "tm", "return_tuple", "keep_module_on_host", "transposed_mode",
               "injection_policy", "injection_dict", "injection_policy_tuple", "replace_method")
# DeepSpeed keys shardwise does not implement, with the value that means "not used"
UNUSED_DEFAULTS: dict[str, Any] = {
    "checkpoint": None, "base_dir": "", "save_mp_checkpoint_path": None, "checkpoint_config": {},
    "ckpt_config": {}, "set_empty_params": False, "training_mp_size": 1, "zero": {}, "moe": {},
    "quant": {}, "mpu": None, "ep_size": 1, "ep_group": None, "expert_group": None, "ep_mp_group": None,
    "expert_mp_group": None, "moe_experts": [1], "moe_type": "standard",
}
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NOTED: set[str] = set()


def init_inference(model: nn.Module | str | os.PathLike, config: str | os.PathLike | dict | None = None,
                   **kwargs: Any) -> nn.Module:
    """The model ready for ``generate()``/forward, its weights placed as the options say.

    ``model``: an ``nn.Module`` or a ``save_pretrained`` folder. ``config``: DeepSpeed's inference
    config (a dict or a JSON file); ``kwargs`` override it, as in DeepSpeed. Options: shardwise's
    (``tensor_parallel_size``, ``offload``, ``dtype``, ``prefetch``, ``quantize``, ``group_size``,
    ``progress``) and DeepSpeed's (see the module docstring).
    """
    from shardwise.inference.load import init_inference as prepare

    if isinstance(config, int) and not isinstance(config, bool):  # an old positional tensor_parallel_size
        kwargs.setdefault("tensor_parallel_size", config)
        config = None
    options = _merged(config, kwargs)
    out = prepare(model, **_translate(options))
    object.__setattr__(out, "module", out)  # DeepSpeed's engine.module; not registered as a submodule
    return out


def _merged(config: str | os.PathLike | dict | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    if config is None or isinstance(config, dict):
        base = dict(config or {})
    else:
        base = read_config(config)
    return {**base, **kwargs}


def _translate(options: dict[str, Any]) -> dict[str, Any]:
    """shardwise's keywords from a DeepSpeed-style option set (refusing what would change the math)."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key in OWN:
            out[key] = value
        elif key in ("tensor_parallel", "tp"):
            _set_tp(out, _tp_size(value), key)
        elif key == "mp_size":
            _set_tp(out, _positive_int(value, key), key)
        elif key in KERNEL_ONLY:
            _note(key)
        elif key in UNUSED_DEFAULTS:
            if value != UNUSED_DEFAULTS[key] and value is not None:
                raise NotImplementedError(f"init_inference: '{key}' is not implemented in shardwise (got {value!r}); "
                                          f"leave it at its default {UNUSED_DEFAULTS[key]!r}")
        else:
            known = OWN + KERNEL_ONLY + tuple(UNUSED_DEFAULTS) + ("tensor_parallel", "tp", "mp_size")
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"init_inference: unknown option '{key}'{hint}")
    if "dtype" in out:
        out["dtype"] = _dtype(out["dtype"])
    return out


def _set_tp(out: dict[str, Any], size: int, key: str) -> None:
    if out.get("tensor_parallel_size", size) != size:
        raise ConfigError(f"init_inference: '{key}' asks for {size} tensor-parallel ranks but another option "
                          f"asks for {out['tensor_parallel_size']}")
    out["tensor_parallel_size"] = size


def _tp_size(value: Any) -> int:
    """DeepSpeed's ``tensor_parallel`` section: ``{"tp_size": n, "enabled": bool, ...}`` or its config object."""
    section = value if isinstance(value, dict) else getattr(value, "__dict__", None)
    if not isinstance(section, dict):
        raise ConfigError(f"init_inference: tensor_parallel must be a dict such as {{'tp_size': 2}}, not {value!r}")
    for key in ("mpu", "tp_group"):
        if section.get(key) is not None:
            raise NotImplementedError(f"init_inference: tensor_parallel.{key} is not implemented: shardwise builds "
                                      "the tensor-parallel group itself (all ranks of the job)")
    unknown = set(section) - {"enabled", "tp_size", "tp_grain_size", "mpu", "tp_group"}
    if unknown:
        raise ConfigError(f"init_inference: unknown tensor_parallel option(s) {sorted(unknown)}")
    if section.get("enabled", True) is False:
        return 1
    return _positive_int(section.get("tp_size", 1), "tensor_parallel.tp_size")


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"init_inference: {key} must be a positive integer, got {value!r}")
    return value


def _dtype(value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype) and value in (torch.float16, torch.bfloat16, torch.float32):
        return value
    name = str(getattr(value, "value", value)).lower()  # DeepSpeed's DtypeEnum carries the dtype as value
    try:  # the one dtype-name table (shardwise.files.safetensors_io), limited to compute dtypes
        dtype = dtype_from_name(name)
    except ValueError:
        dtype = None
    if dtype in _COMPUTE_DTYPES:
        return dtype
    if "int8" in name:
        raise NotImplementedError("init_inference: dtype int8 (DeepSpeed's int8 kernels) is not implemented; "
                                  "use quantize='int8' (weight-only, streamed) instead")
    raise ConfigError(f"init_inference: dtype must be fp32, fp16 or bf16, got {value!r}")


def _note(key: str) -> None:
    if key in _NOTED:
        return
    _NOTED.add(key)
    if os.environ.get("RANK", "0") == "0":
        print(f"shardwise: init_inference option '{key}' selects DeepSpeed kernels or buffers only; "
              "ignored (the model's own modules compute the same function)", file=sys.stderr)
