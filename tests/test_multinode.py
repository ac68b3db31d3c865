"""Two "nodes" on this machine (two `shardwise launch` process trees over loopback) form one job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from test_zero import _check_equivalent
from zero_cases import make_config, reference

HERE = os.path.dirname(os.path.abspath(__file__))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stage", [3])
@pytest.mark.subprocess
def test_two_nodes_hybrid_sharding_matches_single_process(tmp_path, stage):
    port = _port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "shardwise.cli", "launch", "--nnodes", "2", "--node-rank", str(n), "--nproc", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--",
         os.path.join(HERE, "multinode_job.py"), str(tmp_path), str(stage)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], logs
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["node"] for r in ranks] == ["0", "0", "1", "1"]  # ranks 0-1 on node 0: a node is a shard group
    results = [{"losses": r["losses"]} for r in ranks]
    results[0]["weights"] = torch.load(tmp_path / "weights.pt")
    cfg = make_config(stage, dp=4, mics_shard_size=2)
    _check_equivalent(results, reference("llama", cfg, world=4))
    assert all(r["across"] > 0 for r in ranks)  # the replicas (one per node) exchanged gradient shards
