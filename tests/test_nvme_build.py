"""NVMe offload's build (tests/nvme_build_cases.py): every master is made a piece at a time straight into its
swap file, never whole on the host (the host holds the buffers from the start), and the masters in the
files are CPU offload's to the bit; with no optimizer the masters are made on the host after all."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(("stage", "precision", "param_nvme", "sub_group_size"), [
    (2, "bf16", False, 3000), (3, "bf16_states", False, 1_000_000_000), (3, "bf16", True, 1_000_000_000)])
def test_the_build_makes_each_master_in_its_swap_file(pool1, stage, precision, param_nvme, sub_group_size):
    r = pool1.run("nvme_build_cases:build_makes_no_master", stage, precision, param_nvme, sub_group_size)[0]
    assert r["stand_ins_at_open"] and r["pending"], r  # the builder made no master
    assert r["fills"] and all(r["fills"]), r  # while each piece was made, every master was still a stand-in
    assert r["pieces"] > 1 and not any(r["left_start"]), r  # the shards' references dropped after
    assert r["same_as_cpu_offload"], r


def test_no_optimizer_makes_the_masters_on_the_host(pool1):
    r = pool1.run("nvme_build_cases:no_optimizer_makes_masters_on_the_host", 2)[0]
    assert r["nvme"] and r["real"] and all(r["real"]) and not any(r["pending"]), r
