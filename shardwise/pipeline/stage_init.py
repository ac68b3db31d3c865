"""A Hugging Face model built for pipeline stages: each rank materializes its own stage's parameters only.

``with shardwise.pipeline.stage_init(): model = AutoModelForCausalLM.from_config(cfg)`` (or
``from_pretrained(folder)``) builds the model with every parameter on the meta device (no bytes).
``initialize(model=model, config={"pipeline": {"stages": N}})`` then cuts it (``pipeline/hf.py``) and
gives real values to this rank's stage's parameters alone; the other stages' stay on meta.

The values are the whole build's, bit for bit:

- ``from_config``: the model's code runs as it would (its constructors' and ``post_init``'s inits),
  but each init call that reaches a meta parameter is recorded (the call, its arguments and, for a
  random one, the generator's state just before it) and, when it draws random numbers, run on a
  scratch tensor of the parameter's shape and strides that is dropped at once. So the generator
  advances exactly as in the whole build (later parameters, and whatever the script draws after the
  build, get the same numbers) while only one parameter's worth of scratch exists at a time. A stage
  parameter is then made real by replaying its recorded calls, each random one from its recorded
  state. Calls that reach a parameter through a view (``weight[pad].zero_()``, ``weight.data``) are
  recorded with the view's recipe and replayed through it.
- ``from_pretrained(folder)``: nothing is read while building; each stage parameter is read from
  the folder's safetensors by its name (a tied head by the embedding's), its stored shape checked
  against the parameter's before anything is allocated, and cast to the model's dtype as
  ``from_pretrained`` casts it (``sharded_init``'s reader: headers validated, paths confined).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from shardwise.engine.compat import UsageError
from shardwise.sharded_init.context import SafetensorsSource, params_on_meta, swap_contents, tied_aliases

# init calls that draw from a generator (torch.nn.init's and Tensor's in-place samplers)
RANDOM = frozenset({"uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
                    "trunc_normal_", "orthogonal_", "sparse_", "random_", "bernoulli_", "exponential_", "geometric_",
                    "log_normal_", "cauchy_"})


# the dunder methods that write into their tensor (``w.data[pad] = 0``, ``w *= 2``)
WRITES = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})


def _name(func: Any) -> str:
    return getattr(func, "__name__", "") or ""


def _target(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs.get("tensor")


def _rest(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments without its target tensor (torch.nn.init passes it as ``tensor=``)."""
    return (args[1:], dict(kwargs)) if args else ((), {k: v for k, v in kwargs.items() if k != "tensor"})


def _call(func: Any, target: torch.Tensor, args: tuple, kwargs: dict, by_keyword: bool) -> Any:
    return func(tensor=target, **kwargs) if by_keyword else func(target, *args, **kwargs)


class Recorder(TorchFunctionMode):
    """Records the in-place calls that reach meta parameters (and views of them); runs the random
    ones on scratch so the generator moves as in the whole build."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.logs: dict[int, list[tuple]] = {}  # root parameter id -> its calls
        self.views: dict[int, tuple[torch.Tensor, list[tuple]]] = {}  # view id -> (root, recipe from the root)
        self.keep: list[torch.Tensor] = []  # the roots and views seen (their ids stay theirs while recording)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}  # the draws' scratch, per dtype (while building)

    def _scratch(self, target: torch.Tensor) -> torch.Tensor:
        """Where a random init's draws go: a view of one buffer per dtype, grown to the largest parameter
        (a fresh tensor per call would leave the host allocator's heap fragmented by the generator states
        kept between them: measured, the whole model's bytes in RSS), or a tensor of the target's strides
        when they are not contiguous ones (a sampler may draw differently there)."""
        if not target.is_contiguous():
            return torch.empty_strided(target.shape, target.stride(), dtype=target.dtype)
        buf = self.buffers.get(target.dtype)
        if buf is None or buf.numel() < target.numel():
            self.buffers[target.dtype] = buf = None  # the old one freed before the larger is made
            self.buffers[target.dtype] = buf = torch.empty(target.numel(), dtype=target.dtype)
        return buf[:target.numel()].view(target.shape)

    def _root(self, t: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        if id(t) in self.views:
            return self.views[id(t)]
        return t, []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target, name = _target(args, kwargs), _name(func)
        if self.paused or not isinstance(target, torch.Tensor) or not target.is_meta or name == "__get__":
            out = func(*args, **kwargs)
            if not self.paused and isinstance(target, torch.Tensor) and target.is_meta and name == "__get__":
                self._alias(target, out, func, (), {}, False)  # ``weight.data``: the same tensor
            return out
        rest, kw = _rest(args, kwargs)
        by_keyword = not args
        if (not name.endswith("_") or name.startswith("__")) and name not in WRITES:  # a view or a new tensor
            out = func(*args, **kwargs)
            self._alias(target, out, func, rest, kw, by_keyword)
            return out
        root, recipe = self._root(target)
        state = None
        if name in RANDOM:
            gen = kw.get("generator") or torch.default_generator
            state = gen.get_state()
            _call(func, self._scratch(target), rest, kw, by_keyword)  # the whole build's draws, into nothing kept
        else:
            func(*args, **kwargs)  # on meta: nothing computed
        self.logs.setdefault(id(root), []).append((recipe, func, rest, kw, by_keyword, state))
        root.__dict__["_shardwise_stage_recorder"] = self  # materialize_stage finds its log through it
        self.keep.append(root)
        return target

    def _alias(self, source: torch.Tensor, out: Any, func: Any, rest: tuple, kw: dict, by_keyword: bool) -> None:
        if isinstance(out, torch.Tensor) and out.is_meta and out is not source:
            root, recipe = self._root(source)
            self.views[id(out)] = (root, [*recipe, (func, rest, kw, by_keyword)])
            self.keep.append(out)

    def replay(self, p: nn.Parameter, name: str) -> torch.Tensor:
        """``p``'s values as the whole build left them (its recorded calls, random ones from their states)."""
        calls = self.logs.get(id(p))
        if not calls:
            raise UsageError(f"pipeline stages: the parameter {name} was built under stage_init() but never "
                             "initialized (no init call reached it), so its whole-build values are unknown; give "
                             "its module reset_parameters() or an HF _init_weights")
        real = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype)
        for recipe, func, rest, kw, by_keyword, state in calls:
            target = real
            for vfunc, vrest, vkw, vkey in recipe:
                target = _call(vfunc, target, vrest, vkw, vkey)
            if any(isinstance(a, torch.Tensor) and a.is_meta for a in (*rest, *kw.values())):
                raise UsageError(f"pipeline stages: {name} was initialized from another meta tensor "
                                 f"({_name(func)}), which stage_init() cannot replay; build the model whole")
            if state is None:
                _call(func, target, rest, kw, by_keyword)
                continue
            gen = kw.get("generator") or torch.default_generator
            saved = gen.get_state()
            gen.set_state(state)
            try:
                _call(func, target, rest, kw, by_keyword)
            finally:
                gen.set_state(saved)
        return real


@contextlib.contextmanager
def stage_init() -> Iterator[Recorder]:
    """Build a model whose parameters stay on meta until ``initialize`` gives its stage's real values."""
    from transformers import PreTrainedModel

    recorder = Recorder()
    original = PreTrainedModel.__dict__["from_pretrained"]

    def from_pretrained(cls: Any, path: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        from transformers import AutoConfig

        config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
        recorder.paused = True  # nothing drawn: the folder gives every value
        try:
            dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
            model = cls._from_config(config, **({"dtype": dtype} if dtype not in (None, "auto") else {}))
        finally:
            recorder.paused = False
        model._shardwise_source = Path(path)
        return model

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    try:
        with params_on_meta(), recorder:
            yield recorder
    finally:
        PreTrainedModel.from_pretrained = original
    recorder.keep = [t for t in recorder.keep if isinstance(t, nn.Parameter)]  # views are no longer needed
    recorder.views.clear()
    recorder.buffers.clear()


@torch.no_grad()
def materialize_stage(stage: nn.Module, model: nn.Module) -> int:
    """Give ``stage``'s meta parameters (a part of ``model``) their whole-build values; returns the bytes
    made real. ``model`` built under :func:`stage_init` (or ``zero.Init``'s ``from_pretrained``)."""
    metas = {id(p): p for p in stage.parameters() if p.is_meta}
    if not metas:
        return 0
    names = tied_aliases(model)
    source = getattr(model, "_shardwise_source", None)
    recorders = {getattr(p, "_shardwise_stage_recorder", None) for p in metas.values()} - {None}
    if source is None and not recorders:
        raise UsageError("pipeline stages: the model's parameters are on the meta device but it was not built "
                         "under shardwise.pipeline.stage_init() (nor from a folder under shardwise.zero.Init); "
                         "build it there, or whole")
    files = SafetensorsSource(source, model) if source is not None else None
    made = 0
    for p in metas.values():
        name = names[id(p)][0]
        if files is not None:  # the stored tensor's shape is checked against the parameter's before reading
            value = files.read(name, p.shape, 0, p.numel(), names[id(p)][1:]).view(p.shape).to(p.dtype)
        else:
            recorder = getattr(p, "_shardwise_stage_recorder", None)
            if recorder is None:
                raise UsageError(f"pipeline stages: the parameter {name} is on the meta device with no recorded "
                                 "init (built outside shardwise.pipeline.stage_init()?)")
            value = recorder.replay(p, name)
            recorder.logs.pop(id(p), None)  # replayed once: its calls and generator states go
            p.__dict__.pop("_shardwise_stage_recorder", None)
        swap_contents(p, nn.Parameter(value, requires_grad=p.requires_grad))
        made += value.numel() * value.element_size()
    if files is not None:
        stage.bytes_read = files.bytes_read  # the folder's bytes this rank read: its stage's tensors only
    return made
