"""`shardwise train`: the main job (options, model, data, loop, outputs); see docs/train.md.

``main`` imports the job (torch, transformers) only when called, so ``shardwise train --help`` and
the options module load without them.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run ``shardwise train`` with ``argv`` (the command's arguments)."""
    from shardwise.train.run import main as run_main

    return run_main(argv)


__all__ = ["main"]
