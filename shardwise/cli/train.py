"""``shardwise train``: the flags and run config read here, then the job (``shardwise.train.run``).

The job (torch, transformers) is imported only when it runs, so ``shardwise train --help`` and a
refused flag answer without them.
"""

from __future__ import annotations

from shardwise.cli.train_options import parse_args


def main(argv: list[str] | None = None) -> int:
    """Run ``shardwise train`` with ``argv`` (the command's arguments)."""
    args = parse_args(argv)
    from shardwise.train.run import main as run_job

    return run_job(args)
