"""One rank of the two-"node" job in test_multinode.py: hybrid stage 3 with the shard group = a node."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from zero_cases import make_config, train_ranks  # noqa: E402

import shardwise  # noqa: E402


def main() -> None:
    out, stage = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    shardwise.init_distributed()
    dp = int(os.environ["WORLD_SIZE"])
    cfg = make_config(stage, dp=dp, mics_shard_size=int(os.environ["LOCAL_WORLD_SIZE"]))
    res = train_ranks("llama", cfg)
    mine = {"rank": dist.get_rank(), "node": os.environ["GROUP_RANK"], "losses": res["losses"],
            "across": res["comm"].get("all_reduce_across_groups", 0)}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(mine, f)
    if dist.get_rank() == 0:
        torch.save(res["weights"], os.path.join(out, "weights.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
