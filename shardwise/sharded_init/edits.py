"""Refuse, under ``zero.Init``, a parameter edit that materialization would not reproduce.

Inside ``zero.Init`` parameters live on the meta device, so an in-place init a model's
``__init__`` applies to a submodule's parameter after that submodule was built (a custom
``nn.init.normal_(self.fc.weight, std=...)``, ``constant_`` on a bias, scaling one projection)
computes nothing. ``initialize`` later gives each parameter its values by running its module's
``reset_parameters()`` (or the HF model's ``_init_weights``), which knows nothing of that edit: the
model would silently start from another initialization than the same code gives outside
``zero.Init``. DeepSpeed keeps such edits (it partitions real values). This watch records each
parameter's autograd version when its module is attached to a parent (its own ``__init__`` is
then over) and after an HF ``post_init``; a later in-place change is refused when the context ends.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook


class EditWatch:
    def __init__(self) -> None:
        self.base: dict[int, tuple[nn.Parameter, int]] = {}
        self._handle: Any = None

    def start(self) -> None:
        self._handle = register_module_module_registration_hook(self._attached)

    def _attached(self, module: nn.Module, name: str, sub: nn.Module | None) -> None:
        if sub is None:
            return
        for p in sub.parameters():
            if p.is_meta:
                self.base.setdefault(id(p), (p, p._version))  # the first attach: the owner's build is over

    def rebase(self, model: nn.Module) -> None:
        """After an HF ``post_init``: its ``_init_weights`` is what materialization replays."""
        for p in model.parameters():
            if p.is_meta:
                self.base[id(p)] = (p, p._version)

    def stop(self, check: bool) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        edited = [p for p, v in self.base.values() if p.is_meta and p._version != v and _owner(p) is not None]
        self.base.clear()
        if check and edited:
            raise ValueError(
                f"zero.Init: {len(edited)} parameter(s) (e.g. {_describe(edited[0])}) were changed in place "
                "after their module was built (a custom init in a parent module's __init__). Under zero.Init "
                "parameters are created empty and later initialized by their module's reset_parameters() "
                "(or the HF model's _init_weights), so that change would be lost. Move the custom init into "
                "reset_parameters()/_init_weights, build the model outside zero.Init, or load it from a "
                "checkpoint")


def _owner(p: nn.Parameter) -> tuple[nn.Module, str] | None:
    """The module that still holds ``p`` and its name there (None: replaced, e.g. by weight tying)."""
    ref = getattr(p, "_shardwise_owner", None)
    owner = ref() if ref is not None else None
    if owner is None:
        return None
    name = next((n for n, q in owner._parameters.items() if q is p), None)
    return (owner, name) if name is not None else None


def _describe(p: nn.Parameter) -> str:
    owner, name = _owner(p)
    return f"{type(owner).__name__}.{name} of shape {tuple(p.shape)}"
