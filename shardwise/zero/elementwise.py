"""Which optimizers may step a flat shard: those whose state and update are per element.

ZeRO hands the optimizer this rank's 1/N of a flat buffer of parameters laid end to end. That is
exact only for an optimizer whose update of element ``i`` reads nothing but element ``i`` (its
gradient, its value, its own state): SGD, the Adam family, Adagrad, RMSprop, ... Any optimizer that
looks at a tensor as a whole (Adafactor's row and column statistics, Muon's orthogonalization, LAMB's
per-tensor trust ratio) would see a 1-D slice that is part of one parameter and part of the next,
and compute something else without an error. So such optimizers step whole tensors instead
(``zero/whole_tensor.py``), and an optimizer is elementwise only when shardwise knows it is:

* the ``torch.optim`` classes listed below, exactly or subclassed without overriding ``step``, and
  DeepSpeed's own Adam / Adagrad / Lion classes (by name);
* a class registered with :func:`register_elementwise` (or used as its decorator);
* a class with the attribute ``shardwise_elementwise = True`` (``False`` forces whole tensors).
"""

from __future__ import annotations

import inspect

import torch

# Per-element state and update (read from their torch implementations): flat shards are exact.
_TORCH_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta",
                      "Rprop", "ASGD", "SparseAdam")
_REGISTERED: set[type] = {getattr(torch.optim, n) for n in _TORCH_ELEMENTWISE if hasattr(torch.optim, n)}

# DeepSpeed's own per-element optimizers, known by name (DeepSpeed need not be installed to import this).
_DEEPSPEED_ELEMENTWISE = ("FusedAdam", "DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "FusedLion", "DeepSpeedCPULion")

FLAG = "shardwise_elementwise"


def register_elementwise(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """Declare ``cls`` elementwise: shardwise then steps it on flat shards (returns ``cls``: a decorator).

    Only declare what is true: an update of element ``i`` that reads any other element (a norm, a
    mean, a matrix product over the tensor) is silently wrong on a shard."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_elementwise({cls!r}): expected a torch.optim.Optimizer subclass")
    _REGISTERED.add(cls)
    return cls


def is_elementwise(optimizer: torch.optim.Optimizer | type) -> bool:
    """Does ``optimizer`` (an instance or a class) update each element from that element alone?"""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    flag = getattr(cls, FLAG, None)
    if flag is not None:
        return bool(flag)
    if _is_deepspeed_module(cls.__module__) and cls.__name__ in _DEEPSPEED_ELEMENTWISE:
        return True
    for base in cls.__mro__:
        if base in _REGISTERED:
            # a subclass that keeps the registered class's step keeps its per-element update
            return _step_of(cls) is _step_of(base)
    return False


def _step_of(cls: type) -> object:
    """The ``step`` function ``cls`` runs, unwrapped (torch wraps it with profiling hooks on first use)."""
    owner = next(c for c in cls.__mro__ if "step" in vars(c))
    return inspect.unwrap(vars(owner)["step"])


def _is_deepspeed_module(module: str) -> bool:
    """DeepSpeed's own classes, or the facade's same-named stand-ins (``shardwise.deepspeed.ops``)."""
    return module.split(".")[0] == "deepspeed" or module.startswith("shardwise.deepspeed.")
