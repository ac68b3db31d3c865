"""shardwise's DeepSpeed facade: ``import deepspeed`` served by shardwise, opt-in.

Hugging Face's Trainer, Accelerate, PEFT and TRL import ``deepspeed`` and call it directly; with
the facade installed they run on shardwise unchanged. Three ways in (docs/hf_trainer.md):

* ``shardwise launch --as-deepspeed [flags] script.py ARGS``: every rank gets the facade;
* ``shardwise.install_as_deepspeed()`` before importing transformers / accelerate (as
  ``pymysql.install_as_MySQLdb()``);
* plain ``torchrun``: ``PYTHONPATH=$(python -m shardwise.deepspeed hook DIR):$PYTHONPATH``.

A DeepSpeed that happens to be installed is never used while the facade is on: the facade's
finder answers first for every ``deepspeed`` module and for its package metadata, and says so once
on stderr.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from pathlib import Path

from shardwise.deepspeed.finder import FacadeModule, put_first
from shardwise.deepspeed.hook import HOOK_MARKER, write_hook
from shardwise.deepspeed.missing import DeepSpeedNameNotImplemented
from shardwise.deepspeed.surface import API_LEVEL, SURFACE, VERSION, name_table

__all__ = ["install_as_deepspeed", "write_hook", "name_table", "DeepSpeedNameNotImplemented", "API_LEVEL",
           "VERSION", "SURFACE", "real_deepspeed_location"]

_warned = False


def real_deepspeed_location() -> str | None:
    """Where an installed DeepSpeed lives on ``sys.path`` (None when none is), hooks skipped."""
    paths = [p for p in sys.path if not (Path(p or ".") / HOOK_MARKER).exists()]
    spec = importlib.machinery.PathFinder.find_spec("deepspeed", paths)
    return None if spec is None else (spec.origin or str(list(spec.submodule_search_locations or [])))


def _refuse_real_import() -> None:
    """A real DeepSpeed already imported cannot be swapped out under the code holding it."""
    mod = sys.modules.get("deepspeed")
    if mod is None or isinstance(mod, FacadeModule) or getattr(mod, "__shardwise_hook__", False):
        return
    raise RuntimeError(f"install_as_deepspeed(): a real DeepSpeed ({getattr(mod, '__file__', mod)}) was imported "
                       "first; call shardwise.install_as_deepspeed() before anything imports deepspeed, "
                       "transformers or accelerate")


def install_as_deepspeed() -> None:
    """Make ``import deepspeed`` (and every ``deepspeed.*``, and ``importlib.metadata``'s view of
    the ``deepspeed`` package) resolve to shardwise. Idempotent; call it before importing
    transformers or accelerate, which decide at import time whether DeepSpeed is available."""
    global _warned
    _refuse_real_import()
    real = real_deepspeed_location()
    if real is not None and not _warned and os.environ.get("RANK", "0") == "0":
        print(f"shardwise: DeepSpeed is installed ({real}) but not used: `import deepspeed` is shardwise's "
              f"DeepSpeed facade (API level {API_LEVEL})", file=sys.stderr)
    _warned = True
    put_first()
    if not isinstance(sys.modules.get("deepspeed"), FacadeModule):
        sys.modules.pop("deepspeed", None)  # the PYTHONPATH hook's stand-in, replaced by the facade
        importlib.import_module("deepspeed")
