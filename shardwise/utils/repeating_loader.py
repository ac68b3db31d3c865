"""DeepSpeed's ``RepeatingLoader``: an iterable that starts over when exhausted, for step loops."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """Wrap ``loader`` so ``next()`` never raises StopIteration: a new epoch starts instead
    (a ``DistributedSampler`` on the loader gets ``set_epoch`` with the epoch count)."""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self.epoch = 0
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.epoch += 1
            sampler = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
