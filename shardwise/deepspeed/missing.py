"""What the facade answers for a DeepSpeed name shardwise does not implement.

Importing such a name works (libraries import many names they never use); using it (calling it,
reading an attribute, ``isinstance``) raises :class:`DeepSpeedNameNotImplemented` naming it, with
the feature behind it when that is known (Ulysses sequence parallelism, MoE, pipelines, ...).
"""

from __future__ import annotations

from typing import Any

# DeepSpeed module paths (prefixes) whose whole feature shardwise does not implement.
REFUSED_FEATURES: dict[str, str] = {
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPFwdLossBwdWithLogits": "ALST's fused forward-loss-"
        "backward (use shardwise.sequence_parallel.tiled_causal_lm_loss)",
    "deepspeed.sequence": "Ulysses sequence parallelism",
    "deepspeed.utils.groups": "DeepSpeed's expert parallel groups (MoE)",
    "deepspeed.moe.layer": "Mixture of Experts (expert parallelism)",
    "deepspeed.moe.experts": "Mixture of Experts (expert parallelism)",
    "deepspeed.pipe": "pipeline parallelism",
    "deepspeed.runtime.pipe": "pipeline parallelism",
    "deepspeed.PipelineModule": "pipeline parallelism",
    "deepspeed.PipelineEngine": "pipeline parallelism",
    "deepspeed.inference.v2": "DeepSpeed-FastGen inference",
    "deepspeed.compression": "DeepSpeed compression",
    "deepspeed.runtime.zero.tiling": "TiledLinear",
}
DOC = "docs/hf_trainer.md lists every DeepSpeed name the facade serves"


class DeepSpeedNameNotImplemented(NotImplementedError):
    """A DeepSpeed name shardwise's facade does not implement was used."""

    def __init__(self, name: str, use: str = ""):
        self.ds_name = name
        feature = next((f for p, f in REFUSED_FEATURES.items() if name == p or name.startswith(p + ".")), None)
        what = f"{feature} is not implemented by shardwise" if feature else "shardwise does not implement it"
        super().__init__(f"{name}{use}: {what} (shardwise's DeepSpeed facade; {DOC})")


class DeepSpeedEngineNameNotImplemented(DeepSpeedNameNotImplemented, AttributeError):
    """A ``DeepSpeedEngine`` method shardwise's engine does not serve; also an AttributeError, so
    ``hasattr(engine, name)`` is False as for any absent attribute."""


class _MissingMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "NAME" and cls.__name__.endswith("Builder"):  # an op builder's __compatible_ops__ key
            return cls.ds_name
        raise DeepSpeedNameNotImplemented(f"{cls.ds_name}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise DeepSpeedNameNotImplemented(cls.ds_name, " called")

    def __instancecheck__(cls, obj: Any) -> bool:
        raise DeepSpeedNameNotImplemented(cls.ds_name, " in isinstance()")

    def __subclasscheck__(cls, sub: Any) -> bool:
        raise DeepSpeedNameNotImplemented(cls.ds_name, " in issubclass()")


def missing_name(qualname: str) -> type:
    """A stand-in for ``qualname`` that raises, naming it, as soon as it is used."""
    return _MissingMeta(qualname.rsplit(".", 1)[-1], (), {"ds_name": qualname})


def is_missing(obj: Any) -> bool:
    return isinstance(obj, _MissingMeta)
