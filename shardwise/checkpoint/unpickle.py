"""Read pickled checkpoint files (DeepSpeed's ``*.pt``, DCP's ``.metadata`` and ``.distcp`` items)
without executing them.

Built on torch's own restricted unpickler (``torch.load(weights_only=True)``), which admits
tensors, storages (torch's rebuild functions), containers and a few torch types, and refuses every
other global. On top of it:

- the few classes these files hold (DeepSpeed's ``ZeroStageEnum`` and loss scalers, DCP's metadata
  dataclasses) are admitted *by name* through ``torch.serialization.safe_globals`` and mapped to
  plain local stand-ins, so nothing of DeepSpeed is imported (it need not be installed) and no
  method of theirs runs;
- any other global is refused in a :class:`CheckpointError` naming the file and the global;
- every tensor that comes back is checked to lie inside its storage (torch checks this too; a
  tensor whose storage is shorter than its shape is refused by name either way) and to claim no
  more bytes than its storage holds (no stride-0 giant), in one walk that visits each object once
  (a pickle's shared references make a DAG; a tree walk of one can be exponential).
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.fileio import CheckpointError


class StandIn:
    """A plain object with the saved attributes (``__dict__``) of a foreign class; no behaviour."""

    foreign: str = ""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) form
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{self.foreign}: unexpected saved state {type(state).__name__}")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"<{self.foreign} {self.__dict__}>"


class ZeroStageEnum(int):
    """DeepSpeed's ``ZeroStageEnum`` (an IntEnum pickled as ``cls(value)``): just the stage number."""


def _stand_in(fqn: str) -> type:
    return type(fqn.rsplit(".", 1)[1], (StandIn,), {"foreign": fqn})


_DS = "deepspeed.runtime"
_DCP = "torch.distributed.checkpoint.metadata"
STAND_INS: dict[str, type] = {
    f"{_DS}.zero.config.ZeroStageEnum": ZeroStageEnum,
    **{f"{_DS}.fp16.loss_scaler.{c}": _stand_in(f"{_DS}.fp16.loss_scaler.{c}")
       for c in ("LossScaler", "DynamicLossScaler", "LossScalerBase")},
    **{f"{_DCP}.{c}": _stand_in(f"{_DCP}.{c}")
       for c in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta")},
    "deepspeed.utils.tensor_fragment.fragment_address": _stand_in("deepspeed.utils.tensor_fragment.fragment_address"),
    "torch.distributed.checkpoint.filesystem._StorageInfo": _stand_in(
        "torch.distributed.checkpoint.filesystem._StorageInfo"),
}


class _MemFormat(int):
    """DCP's ``_MEM_FORMAT_ENCODING`` enum value (how TensorProperties pickles its memory format)."""


class TensorProperties(StandIn):
    """DCP's TensorProperties, pickled as the tuple (dtype, layout, requires_grad, memory format, pinned)."""

    foreign = f"{_DCP}.TensorProperties"

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[0], torch.dtype)):
            raise pickle.UnpicklingError(f"{self.foreign}: unexpected saved state {state!r}"[:200])
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


STAND_INS[f"{_DCP}._MEM_FORMAT_ENCODING"] = _MemFormat
STAND_INS[f"{_DCP}.TensorProperties"] = TensorProperties


def _layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout``'s job, for the layouts torch has (nothing else is looked up)."""
    value = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return value


def _path_text(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a pathlib path with non-text parts")
    return "/".join(parts)


class RestrictedUnpickler(pickle.Unpickler):
    """For plain pickles (DCP's ``.metadata``): the stand-ins, torch dtypes/layouts/Size and
    OrderedDict; every other global refused by name. No persistent ids (no storages)."""

    def find_class(self, module: str, name: str) -> Any:
        fqn = f"{module}.{name}"
        if fqn in STAND_INS:
            return STAND_INS[fqn]
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if fqn == "torch.serialization._get_layout":
            return _layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return _path_text  # DCP's StorageMeta records the writer's checkpoint_id: kept as text, never opened
        if fqn == "collections.OrderedDict":
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {fqn}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids (storages) are not expected in this file")


def safe_load_pickle(path: Path) -> Any:
    """A plain pickle file read through :class:`RestrictedUnpickler`, or a CheckpointError naming it."""
    try:
        with open(path, "rb") as f:
            return RestrictedUnpickler(f).load()
    except pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e))
        what = f"global {found.group(1)!r}" if found else str(e)[:300]
        raise CheckpointError(f"{path}: refused to unpickle: {what} is not a known checkpoint class (nothing in "
                              "the file was executed)") from None
    except (EOFError, ValueError, TypeError, KeyError, AttributeError, IndexError, OSError,
            RecursionError, MemoryError) as e:
        raise CheckpointError(f"{path}: not a readable pickle ({type(e).__name__}: {e})"[:400]) from None

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, list | tuple):
        return list(obj)
    if isinstance(obj, StandIn):
        return list(obj.__dict__.values())
    return []


def check_tensor(t: torch.Tensor, source: Path) -> None:
    """``t`` lies inside its storage and claims no more bytes than the storage holds.

    The second rule bounds every later copy of ``t`` (``torch.cat``, ``reshape``, ``float``) by
    bytes the file really holds: a stride-0 tensor that repeats one element ``2**30`` times is
    legal to torch but is refused here (checkpoints save dense tensors).
    """
    if t.numel() == 0:
        return
    have = t.untyped_storage().nbytes()
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    need = (t.storage_offset() + extent) * t.element_size()
    if any(st < 0 for st in t.stride()) or need > have:
        raise CheckpointError(f"{source}: a tensor of shape {list(t.shape)} needs {need} bytes, its storage "
                              f"holds {have}; refused")
    if t.numel() * t.element_size() > have:
        raise CheckpointError(f"{source}: a tensor of shape {list(t.shape)} and strides {list(t.stride())} "
                              f"claims {t.numel() * t.element_size()} bytes, its storage holds {have}; refused")


def _check_tensors(root: Any, source: Path) -> None:
    """Every tensor reachable from ``root`` passes :func:`check_tensor`.

    Each object is visited once (by identity): a pickle may share references, and a chain of
    40 lists that each hold the next one twice is 2**40 paths but 40 objects. Nesting is bounded
    at 64 levels (deeper is not a checkpoint).
    """
    seen: set[int] = set()
    stack = [(root, 0)]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if depth > 64:
            raise CheckpointError(f"{source}: nesting deeper than 64 levels")
        if torch.is_tensor(obj):
            check_tensor(obj, source)
        else:
            stack.extend((c, depth + 1) for c in _children(obj))


def safe_load(data: Path | bytes, source: Path, mmap: bool = False) -> Any:
    """Unpickle a torch-saved file (or the bytes of one) without running any of it.

    ``source`` names the file in errors. A global outside the allow-list is refused by name.
    """
    globals_ = [(cls, fqn) for fqn, cls in STAND_INS.items()]
    try:
        with torch.serialization.safe_globals(globals_):
            if isinstance(data, bytes):
                obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            else:
                obj = torch.load(data, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e))
        what = f"global {found.group(1)!r}" if found else str(e).splitlines()[0][:300]
        raise CheckpointError(f"{source}: refused to unpickle: {what} is not a tensor, container or known "
                              "checkpoint class (nothing in the file was executed)") from None
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever torch's reader raises on damaged bytes (IndexError too)
        raise CheckpointError(f"{source}: not a readable torch checkpoint file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:300] if str(e) else ''})") from None
    _check_tensors(obj, source)
    return obj
