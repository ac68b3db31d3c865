"""Two ranks, rank 1 killed by SIGKILL (the kernel's OOM killer), for the launcher's exit tests.

``python -m shardwise.launch.agent --subcommand ... killed_rank_worker.py``: both ranks all-reduce
once on gloo; rank 1 then SIGKILLs itself; rank 0's next all-reduce fails and it ends as a
shardwise subcommand does when a peer died: its own one line, exit 4 (``os._exit``, as
``shardwise train`` does: the group is unusable). Only torch is imported: the launcher's report
is the subject, not what the ranks compute.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - a broken collective: the subcommand's one line, exit 4
        print(f"error: all_reduce failed on rank 0 of 2 ({type(e).__name__}): a peer process died", file=sys.stderr,
              flush=True)
        os._exit(4)
    os._exit(0)  # not reached: the peer is gone


if __name__ == "__main__":
    main()
