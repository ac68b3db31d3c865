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
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.comm.host import broadcast_through_device
from shardwise.sharded_init.edits import EditWatch
from shardwise.sharded_init.folder_source import SafetensorsSource, weight_map  # noqa: F401 - weight_map re-exported


class Init:
    """Context manager: models built inside are materialized shard by shard by ``initialize``."""

    def __init__(self, config: Any = None, enabled: bool = True, dtype: torch.dtype | None = None,
                 **_ignored: Any):
        self.enabled, self.dtype = enabled, dtype
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if not torch.distributed.is_initialized() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            from shardwise.comm.compat import init_distributed  # as DeepSpeed's Init: join the launched job

            init_distributed()
        self._meta = params_on_meta()
        self._meta.__enter__()
        self._watch = EditWatch()  # custom in-place inits the later materialization would not replay
        self._watch.start()
        try:
            from transformers import PreTrainedModel
        except ImportError:  # pragma: no cover - transformers is a dependency
            return self
        dtype, watch = self.dtype, self._watch

        def from_pretrained(cls, path: str | os.PathLike, *args: Any, **kwargs: Any):
            from transformers import AutoConfig

            config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
            want = kwargs.get("dtype", kwargs.get("torch_dtype", dtype))
            model = cls._from_config(config)
            model._shardwise_source = Path(path)
            if isinstance(want, torch.dtype):
                model._shardwise_dtype = want
            return model

        original_post_init = PreTrainedModel.post_init

        def post_init(model: PreTrainedModel) -> None:
            original_post_init(model)
            watch.rebase(model)
            for p in model.parameters():  # the outermost model's post_init runs last
                p._shardwise_root = weakref.ref(model)  # GatheredParameters needs its init / folder

        self._patch(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
        self._patch(PreTrainedModel, "post_init", post_init)
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
            self._watch.stop(check=exc[0] is None)


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Create every module parameter on the meta device (one real tensor at a time; buffers stay real)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        if param is not None:
            param._shardwise_owner = weakref.ref(module)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def is_deferred(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def swap_meta_parameters(model: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """Give each meta parameter a 1-element NaN placeholder of full shape, keeping its identity.

    A meta tensor cannot take real data through ``p.data = ...`` (the device differs), so the
    contents of the Parameter objects are swapped (``torch.utils.swap_tensors``): the objects
    the user holds (``model_parameters``, a client optimizer, ``register_external_parameter``)
    stay the model's parameters. Where a swap is refused (a weakref to the parameter) the
    object is replaced instead. Returns old id -> the parameter now in the model.
    """
    new: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                nan = torch.full((1,), float("nan"), dtype=p.dtype, device=device)
                placeholder = nn.Parameter(nan.expand(p.shape), requires_grad=p.requires_grad)
                try:
                    swap_contents(p, placeholder)
                    new[id(p)] = p
                except RuntimeError:
                    new[id(p)] = placeholder
                new[id(p)]._shardwise_deferred = True  # values come from the checkpoint or the init
            m._parameters[name] = new[id(p)]
    return new


def tied_aliases(model: nn.Module) -> dict[int, list[str]]:
    """Parameter id -> every name it has (tied weights appear under several)."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def swap_contents(p: nn.Parameter, new: nn.Parameter) -> None:
    """``p`` takes ``new``'s tensor in place (same object); its own attributes stay with it
    (``swap_tensors`` would swap the ``__dict__`` too)."""
    attrs = dict(p.__dict__)
    torch.utils.swap_tensors(p, new)
    p.__dict__.update(attrs)


def is_placeholder(p: torch.Tensor) -> bool:
    """A deferred parameter whose values zero.Init has not produced yet (see swap_meta_parameters)."""
    return getattr(p, "_shardwise_deferred", False)


def init_function(model: nn.Module | None):
    """How zero.Init initializes a module: the HF model's ``_init_weights``, else ``reset_parameters``."""
    init = getattr(model, "_init_weights", None) if model is not None else None

    def run(m: nn.Module) -> None:
        if init is not None:
            init(m)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()
        else:
            raise ValueError(f"zero.Init: don't know how to initialize {type(m).__name__}; give it "
                             "reset_parameters() or build the model from a checkpoint")

    return run


@torch.no_grad()
def materialize_by_init(model: nn.Module, params: list[nn.Parameter], device: torch.device) -> None:
    """Give ``params`` real storage and run the model's own init on the modules that own them.

    Parameters that already hold real values (set in ``GatheredParameters`` before
    ``initialize``) keep them, even when their module is re-initialized for a sibling.
    """
    todo = [p for p in params if is_placeholder(p)]
    ids = {id(p) for p in todo}
    for p in todo:
        p.data = torch.empty(p.shape, dtype=p.dtype, device=device)
    init = init_function(model)
    for m in model.modules():
        direct = list(m.parameters(recurse=False))
        if not any(id(p) in ids for p in direct):
            continue
        keep = [(p, p.detach().clone()) for p in direct if id(p) not in ids and not is_placeholder(p)]
        init(m)
        for p, v in keep:
            p.copy_(v)
    for p in todo:
        p.__dict__.pop("_shardwise_deferred", None)


@torch.no_grad()
def materialize_for_gather(params: list[nn.Parameter], comm: Any) -> None:
    """``GatheredParameters`` before ``initialize`` on meta parameters: give them their real values.

    Each Parameter object becomes a full real tensor in place (``swap_tensors``), filled from the
    checkpoint folder of its ``from_pretrained`` model or by the model's own init, then rank 0's
    values are broadcast so every rank sees the same ones. ``initialize`` later shards these as
    they are (see ``materialize_by_init`` and the engine's reader) instead of reading them again.
    """
    for p in params:
        real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        swap_contents(p, real)
    by_root: dict[int, tuple[nn.Module | None, list[nn.Parameter]]] = {}
    for p in params:
        ref = getattr(p, "_shardwise_root", None) or getattr(p, "_shardwise_owner", None)
        root = ref() if ref is not None else None
        if root is None:
            raise ValueError("GatheredParameters before initialize: a meta parameter of a model that no "
                             "longer exists, or that was not built under shardwise.zero.Init")
        by_root.setdefault(id(root), (root, []))[1].append(p)
    for root, ps in by_root.values():
        source = getattr(root, "_shardwise_source", None)
        if source is not None:
            files, aliases = SafetensorsSource(source, root), tied_aliases(root)
            for p in ps:
                names = aliases[id(p)]
                p.copy_(files.read(names[0], p.shape, 0, p.numel(), names[1:]).view(p.shape))
            continue
        ids = {id(p) for p in ps}
        init = init_function(root if hasattr(root, "_init_weights") else None)
        for m in root.modules():
            direct = list(m.parameters(recurse=False))
            if any(id(p) in ids for p in direct):
                keep = [(q, q.detach().clone()) for q in direct if id(q) not in ids and not q.is_meta]
                init(m)
                for q, v in keep:
                    q.copy_(v)
    for p in params:
        broadcast_through_device(comm, p.data, src=0)  # not placed yet: on the host


def defer_again(params: list[nn.Parameter]) -> None:
    """Undo :func:`materialize_for_gather` (edits discarded): back to meta, freeing the values."""
    for p in params:
        swap_contents(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                      requires_grad=p.requires_grad))
