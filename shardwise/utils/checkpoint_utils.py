"""DeepSpeed's ``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``.

``torch.save`` of a view writes its whole storage: a state dict whose tensors are views into one
flat buffer (every sharded group's parameters are) would store that buffer once per tensor. Scripts
written for DeepSpeed clone a state dict with this helper before saving it.
"""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """``item`` with every tensor inside it (nested lists, tuples and dicts) replaced by a detached
    copy of its own on ``device``; everything else is returned as it is."""
    device = torch.device(device)
    if isinstance(item, torch.Tensor):
        copied = item.detach().to(device)
        return copied.clone() if copied.data_ptr() == item.data_ptr() else copied
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    if isinstance(item, (list, tuple)):
        values = [clone_tensors_for_torch_save(v, device) for v in item]
        return values if isinstance(item, list) else tuple(values)
    return item
