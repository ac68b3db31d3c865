"""Entries for ranks forked by tests/fresh_ranks.py whose subject is what a new process starts with
(no process group yet, the environment's defaults), not its imports: each runs in a process of its own."""

from __future__ import annotations


def zero_init_joins_the_job(argv: list[str]) -> None:
    """zero.Init() in a process with the launcher's environment and no group: it joins the job."""
    import torch.distributed as dist

    import shardwise

    assert not dist.is_initialized()
    with shardwise.zero.Init():
        print(dist.is_initialized(), dist.get_world_size())


def timeout_key_applied(argv: list[str]) -> None:
    """shardwise.initialize in a process with no group: prints the collective timeout it joined with."""
    import torch
    import torch.distributed as dist

    import shardwise
    from shardwise.comm.core import _GLOBAL_TIMEOUT

    cfg = {"shardwise": {"timeout_s": 42}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    shardwise.initialize(model=torch.nn.Linear(2, 2), config=cfg)
    print(_GLOBAL_TIMEOUT[0])
    dist.destroy_process_group()
