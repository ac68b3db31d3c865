"""ALST's third memory piece: the inputs activation checkpointing keeps for its recompute, held in host memory.

With activation checkpointing each checkpointed layer keeps one thing until backward: its input
(the hidden states, ``b x s x h`` values), from which backward recomputes the layer. Over ``L``
layers that is ``L x b x s x h`` values, linear in the sequence, and what is left on the device at
long sequences once SP and the tiled pieces have cut the rest. ``offload_checkpoints(model)`` wraps
the checkpoint function HF installs on each checkpointed layer (``_gradient_checkpointing_func``,
set by ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable``) so that a
``saved_tensors_hooks`` pair is active while it saves its inputs: each saved tensor is copied into
a host buffer (pinned, with a non-blocking copy, when it lives on an accelerator) and copied back
when backward unpacks it.

Scope: torch's checkpoint saves the inputs before it enters its own saved-tensor hooks for the
layer's body (``use_reentrant=False``, HF's default), or runs the body under ``no_grad``
(``use_reentrant=True``), so the pair sees the checkpoint inputs and nothing else; tensors saved
outside checkpointed layers (embeddings, the final norm, the LM head) stay where they are
(tests/test_checkpoint_offload.py checks the bytes moved equal the layers' inputs exactly).

Numbers: a copy moves bits and computes nothing, so the recompute sees bitwise the input it would
have seen: losses and gradients are bit-exact against checkpointing without offload. Cost: one
device-to-host copy per layer in forward, one host-to-device copy in backward, on the compute
stream; host memory of the same size. On a CPU-only run host and device are the same memory: the
copy saves nothing there (it is kept so that one config runs on both and the path the GPU takes is
the one tested).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

_KEY = "_shardwise_checkpoint_offload"


class HostStore:
    """The pack/unpack pair, with counts of what it moved (``packed_bytes``: bytes copied to host)."""

    def __init__(self) -> None:
        self.packed = self.unpacked = self.packed_bytes = 0

    def pack(self, t: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        if t.layout != torch.strided:  # sparse and other layouts: left where they are
            return t.device, t
        on_device = t.device.type != "cpu"
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=on_device)
        host.copy_(t, non_blocking=on_device)
        self.packed += 1
        self.packed_bytes += host.nbytes
        return t.device, host

    def unpack(self, packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, host = packed
        self.unpacked += 1
        return host.to(device, non_blocking=device.type != "cpu")


def _offloading(checkpoint: Callable, store: HostStore) -> Callable:
    def offloaded(function: Callable, *args: Any, **kwargs: Any) -> Any:
        with saved_tensors_hooks(store.pack, store.unpack):
            return checkpoint(function, *args, **kwargs)

    offloaded.__dict__[_KEY] = store
    return offloaded


def _wrap_layers(layers: list[nn.Module], store: HostStore) -> bool:
    """Wrap the checkpoint function of every layer with checkpointing on; whether any has it on."""
    on = False
    for layer in layers:
        fn = getattr(layer, "_gradient_checkpointing_func", None)
        if not layer.gradient_checkpointing or fn is None:
            continue
        on = True
        if getattr(fn, _KEY, None) is not store:
            layer._gradient_checkpointing_func = _offloading(fn, store)
    return on


def offload_checkpoints(model: nn.Module) -> HostStore:
    """From ``model``'s next forward with gradients on, hold its checkpoint inputs in host memory.

    Checks at each such forward (a forward pre-hook): layers whose checkpointing was enabled after
    this call are wrapped too; a forward with no checkpointed layer is refused in one line (there
    would be nothing to offload: the key would be silently void). Idempotent; returns the store."""
    existing = model.__dict__.get(_KEY)
    if existing is not None:
        return existing[0]
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    if not layers:
        raise ValueError(f"offload_activation_checkpoints: {type(model).__name__} has no layers HF "
                         "activation checkpointing can checkpoint (no gradient_checkpointing attribute)")
    store = HostStore()

    def check(module: nn.Module, args: tuple) -> None:  # noqa: ARG001
        if torch.is_grad_enabled() and module.training and not _wrap_layers(layers, store):
            raise ValueError("offload_activation_checkpoints is on but activation checkpointing is off: call "
                             "model.activation_checkpointing_enable() (or gradient_checkpointing_enable()) first")

    model.__dict__[_KEY] = (store, model.register_forward_pre_hook(check))
    return store
