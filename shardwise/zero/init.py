"""``shardwise.zero.Init``: build a model already sharded, so it may exceed one rank's memory.

Inside the context every parameter is created on the meta device (one real
tensor at a time, freed at once; buffers stay real), and HF ``from_pretrained``
builds the model from its config without loading weights, remembering the
folder. ``initialize`` then materializes the model one stage-3 unit at a time:
from the safetensors files (each rank reads only the slices of its shards) or,
for ``from_config`` models, by running the model's own weight init on that unit
alone. Peak memory while building is about model/N plus one unit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Init:
    """Context manager: models built inside are materialized shard by shard by ``initialize``."""

    def __init__(self, config: Any = None, enabled: bool = True, dtype: torch.dtype | None = None,
                 **_ignored: Any):
        self.enabled, self.dtype = enabled, dtype
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        self._meta = params_on_meta()
        self._meta.__enter__()
        try:
            from transformers import PreTrainedModel
        except ImportError:  # pragma: no cover - transformers is a dependency
            return self
        dtype = self.dtype

        def from_pretrained(cls, path: str | os.PathLike, *args: Any, **kwargs: Any):
            from transformers import AutoConfig

            config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
            want = kwargs.get("dtype", kwargs.get("torch_dtype", dtype))
            model = cls._from_config(config)
            model._shardwise_source = Path(path)
            if isinstance(want, torch.dtype):
                model._shardwise_dtype = want
            return model

        self._patch(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
        return self

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        self._saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, new)

    def __exit__(self, *exc: Any) -> None:
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        self._saved.clear()
        if getattr(self, "_meta", None) is not None:
            self._meta.__exit__(*exc)
            self._meta = None


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Create every module parameter on the meta device (one real tensor at a time; buffers stay real)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def weight_map(folder: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index or the single file."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        from shardwise.checkpoint.validate import read_weight_map

        return read_weight_map(folder, index)
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                                "(shardwise reads weights from safetensors only)")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a Mapping)


def is_deferred(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


class SafetensorsSource:
    """Reads element ranges of named tensors from an HF safetensors folder (no pickle)."""

    def __init__(self, folder: Path):
        self.files = weight_map(folder)
        self._open: dict[Path, Any] = {}
        self.bytes_read = 0  # rows actually read, to show each rank reads only its slices

    def _handle(self, name: str, aliases: list[str]):
        from safetensors import safe_open

        for n in [name, *aliases]:
            if n in self.files:
                path = self.files[n]
                if path not in self._open:
                    self._open[path] = safe_open(path, framework="pt")
                return self._open[path], n
        raise KeyError(f"{name!r} is not in the checkpoint at {next(iter(self.files.values())).parent}")

    def read(self, name: str, shape: torch.Size, start: int, end: int, aliases: list[str]) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor ``name``: reads whole rows only."""
        f, key = self._handle(name, aliases)
        sl = f.get_slice(key)
        if len(shape) == 0:
            return f.get_tensor(key).reshape(-1)[start:end]
        row = max(1, int(torch.Size(shape[1:]).numel()))
        r0, r1 = start // row, -(-end // row)
        rows = sl[r0:r1]
        self.bytes_read += rows.numel() * rows.element_size()
        return rows.reshape(-1)[start - r0 * row:end - r0 * row]


def swap_meta_parameters(model: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """Replace each meta parameter by a real one holding a 1-element NaN placeholder of full shape.

    A meta tensor cannot take real data in place (``p.data = ...`` refuses the device change),
    so the Parameter objects are swapped, tied ones together. Returns old id -> new parameter.
    """
    new: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                nan = torch.full((1,), float("nan"), dtype=p.dtype, device=device)
                new[id(p)] = nn.Parameter(nan.expand(p.shape), requires_grad=p.requires_grad)
            m._parameters[name] = new[id(p)]
    return new


def tied_aliases(model: nn.Module) -> dict[int, list[str]]:
    """Parameter id -> every name it has (tied weights appear under several)."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


@torch.no_grad()
def materialize_by_init(model: nn.Module, params: list[nn.Parameter], device: torch.device) -> None:
    """Give ``params`` real storage and run the model's own init on the modules that own them."""
    ids = {id(p) for p in params}
    for p in params:
        p.data = torch.empty(p.shape, dtype=p.dtype, device=device)
    init = getattr(model, "_init_weights", None)
    for m in model.modules():
        direct = [p for p in m.parameters(recurse=False) if id(p) in ids]
        if not direct:
            continue
        if init is not None:
            init(m)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()
        else:
            raise ValueError(f"zero.Init: don't know how to initialize {type(m).__name__}; give it "
                             "reset_parameters() or build the model from a checkpoint")
