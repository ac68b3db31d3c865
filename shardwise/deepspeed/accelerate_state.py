"""Accelerate's DeepSpeed path on a machine without an accelerator, made to work with no change to
the script (the documented workaround used to be the script's job: docs/hf_trainer.md).

What goes wrong: ``accelerate.PartialState`` picks its process-group backend from the device; with
no GPU it records none on its DeepSpeed path (``backend=None``) and then calls
``deepspeed.comm.init_distributed(dist_backend=None)``, which starts a gloo group on every rank.
Seeing ``backend is None`` afterwards, the state counts ``num_processes == 1`` although the world
has N ranks, so the HF Trainer fills the config's ``"auto"`` batch size for one process and the
engine refuses the config (``train_batch_size: 2 != 2 x 1 x dp_world (2)``).

What the facade does: its ``init_distributed``, when called from that half-built state (the
state's shared dict holds ``backend=None`` and no process count yet), records the backend the
group really got (gloo) in the state, exactly what ``PartialState(backend="gloo")`` created by the
script beforehand would have recorded. Accelerate then counts the ranks, the Trainer fills the
batch size for N processes, and the run is the one the workaround gave. Nothing changes on GPUs,
where Accelerate chooses NCCL itself, nor for a state built with an explicit backend.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as tdist

from shardwise.comm import compat as comm_api


def _state_being_built() -> dict[str, Any] | None:
    """Accelerate's ``PartialState`` shared dict when it is mid-``__init__`` with no backend."""
    state_mod = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state_mod, "PartialState", None), "_shared_state", None)
    if not isinstance(shared, dict) or not shared or "num_processes" in shared:
        return None
    return shared if shared.get("backend", "") is None else None


def init_distributed(*args: Any, **kwargs: Any) -> None:
    """``deepspeed.comm.init_distributed`` as the facade serves it: shardwise's, then Accelerate's
    half-built state told which backend the group got (see the module docstring)."""
    comm_api.init_distributed(*args, **kwargs)
    shared = _state_being_built()
    if shared is not None and tdist.is_initialized():
        shared["backend"] = tdist.get_backend()


def process_count_note() -> str | None:
    """When Accelerate counted fewer processes than the group has: the reason and the fix, for a
    batch-size refusal (the Trainer filled ``"auto"`` batch sizes for that count)."""
    state_mod = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state_mod, "PartialState", None), "_shared_state", None) or {}
    counted = shared.get("num_processes")
    if not tdist.is_initialized() or counted is None or counted == tdist.get_world_size():
        return None
    return (f"Accelerate counted {counted} process(es) but {tdist.get_world_size()} ranks are running, so the "
            "Trainer filled the \"auto\" batch sizes for the wrong count. The PartialState was built before "
            "the facade could set its backend: create no PartialState/Accelerator yourself before "
            "TrainingArguments, or create it with PartialState(backend=\"gloo\") on CPU (docs/hf_trainer.md)")
