"""The error for a DeepSpeed name shardwise does not implement, naming the feature behind it.

Here, below the facade (``shardwise.deepspeed.missing`` hands these names on), because the engine
raises it too: a ``DeepSpeedEngine`` method the engine does not serve (``ds_surface.refuse``). The
facade maps names onto the engine and the engine never imports the facade.
"""

from __future__ import annotations

# DeepSpeed module paths (prefixes) whose whole feature shardwise does not implement.
REFUSED_FEATURES: dict[str, str] = {
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPFwdLossBwdWithLogits": "ALST's fused forward-loss-"
        "backward (use shardwise.sequence_parallel.tiled_causal_lm_loss)",
    "deepspeed.sequence": "Ulysses sequence parallelism",
    "deepspeed.utils.groups": "DeepSpeed's expert parallel groups (MoE)",
    "deepspeed.moe.layer": "Mixture of Experts (expert parallelism)",
    "deepspeed.moe.experts": "Mixture of Experts (expert parallelism)",
    "deepspeed.pipe.DualPipeVModule": "the DualPipeV pipeline schedule",
    "deepspeed.runtime.pipe.dualpipev": "the DualPipeV pipeline schedule",
    "deepspeed.DualPipeVModule": "the DualPipeV pipeline schedule",
    "deepspeed.DualPipeVEngine": "the DualPipeV pipeline schedule",
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
