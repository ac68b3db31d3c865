"""``unwrap_model_for_generation``: the whole ZeRO-3 model gathered for a block of forwards.

DeepSpeed's ``deepspeed.runtime.zero.unwrap_model_for_generation(engine)`` (used by RL trainers
around ``generate()`` loops) gathers every parameter once so repeated forwards cost no
all-gathers, then re-shards on exit. Here the engine's stage-3 fetcher already has that mode
(``engine.generate`` uses it); the block enters it. Below stage 3 the parameters are whole anyway
and the block changes nothing. Every data-parallel rank must enter the block (a collective).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Yield ``model`` (the engine) with every stage-3 parameter whole until the block ends."""
    fetcher = getattr(model, "fetcher", None)
    if fetcher is None or fetcher.all_gathered:
        yield model
        return
    fetcher.gather_all()
    try:
        yield model
    finally:
        fetcher.release_all()
