"""``shardwise estimate --offload nvme``: the optimizer's host bytes go to disk, the host keeps the buffers."""

from __future__ import annotations

import json

from shardwise.cli.estimate import main


def _json(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_nvme_moves_the_optimizer_host_bytes_to_disk(capsys) -> None:
    cpu = _json(capsys, "--params", "14B", "--devices", "1", "--offload", "optimizer")
    nvme = _json(capsys, "--params", "14B", "--devices", "1", "--offload", "nvme", "--nvme-buffers", "2",
                 "--nvme-group", "100M", "--nvme-bandwidth", "6GB")
    for st in ("1", "2", "3"):
        c, n = cpu["stages"][st], nvme["stages"][st]
        assert n["per_device_bytes"] == c["per_device_bytes"]  # the device holds the same
        assert n["nvme_bytes"] == c["host_bytes"] == 12 * 14 * 10**9  # fp32 master + Adam moments, on disk
        assert n["host_bytes"] == 2 * (12 + 4) * 100 * 10**6  # buffer_count x (k + g) x G: no gradient shard
    assert "I/O per step 2·168.00 GB at 6 GB/s: 56.0 s" in nvme["notes"][-1]


def test_nvme_with_bf16_states_and_ranks(capsys) -> None:
    n = _json(capsys, "--params", "8B", "--devices", "8", "--offload", "nvme", "--master", "states")["stages"]["2"]
    assert n["nvme_bytes"] == 8 * 10**9  # 8 B/param (2 master copy + 2 + 2 moments + 2 Kahan) / 8 ranks
    assert n["host_bytes"] == 4 * (8 + 2) * (500_000_000 // 8)  # each buffer: a group's file and its bf16 gradient


def test_nvme_parameters_put_the_16_bit_shard_on_disk_and_count_their_buffers(capsys) -> None:
    """--nvme-params (stage 3): the device holds parameter offload's bytes; the optimizer part is --offload
    nvme's; the parameter shard less max_in_cpu elements goes to disk, and the host adds the bounce buffers."""
    argv = ["--params", "14B", "--devices", "2", "--offload", "nvme", "--nvme-buffers", "2", "--nvme-group", "778M"]
    opt = _json(capsys, *argv)["stages"]["3"]
    params = _json(capsys, "--params", "14B", "--devices", "2", "--offload", "params")["stages"]["3"]
    n = _json(capsys, *argv, "--nvme-params", "--nvme-param-buffers", "4", "--nvme-param-buffer-size", "1e8",
              "--nvme-max-in-cpu", "1e9", "--nvme-bandwidth", "7GB")
    both = n["stages"]["3"]
    shard = 2 * 7 * 10**9  # bf16 parameters over 2 ranks
    assert both["per_device_bytes"] == params["per_device_bytes"]
    assert both["nvme_bytes"] == opt["nvme_bytes"] + shard - 2 * 10**9  # max_in_cpu 1e9 elements stay
    assert both["host_bytes"] == opt["host_bytes"] + 2 * 10**9 + 4 * 2 * 10**8  # + in-CPU shards + 4 buffers
    assert n["stages"]["2"] == _json(capsys, *argv)["stages"]["2"]  # stages 1-2 do not offload parameters
    assert "Parameter I/O: 2·12.00 GB read per micro-batch" in n["notes"][-1]


def test_nvme_params_without_nvme_offload_is_refused(capsys) -> None:
    assert main(["--params", "1B", "--devices", "1", "--offload", "params", "--nvme-params"]) == 2
    assert "--nvme-params goes with --offload nvme" in capsys.readouterr().err


def test_nvme_sub_groups_bound_the_buffers(capsys) -> None:
    """--nvme-sub-group S: the buffers hold S elements each, plus one split group's gradient for the norm."""
    n = _json(capsys, "--params", "14B", "--devices", "1", "--offload", "nvme", "--nvme-buffers", "4",
              "--nvme-group", "500M", "--nvme-sub-group", "100M")
    assert n["stages"]["2"]["host_bytes"] == 4 * (12 + 4) * 100 * 10**6 + 4 * 500 * 10**6
    assert "S = min(sub_group_size, G) = 100,000,000 elements" in n["notes"][-1]
