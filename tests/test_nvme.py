"""NVMe offload (ZeRO-Infinity's optimizer tier): bit-equal to CPU offload at stages 1-3 with bf16/fp16
compute and bf16 states, really on disk, host memory bounded, checkpoints, faults (tests/nvme_cases.py)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(("stage", "precisions", "param_cpu"), [
    (1, ["bf16", "bf16_states"], False), (2, ["fp16"], False), (3, ["bf16", "fp16", "bf16_states"], False),
    (3, ["bf16"], True)])
def test_nvme_offload_is_cpu_offload_to_the_bit(pool2, stage, precisions, param_cpu):
    """Also beside ``offload_param`` on the CPU (stage 3)."""
    res = pool2.run("nvme_cases:cpu_vs_nvme", stage, precisions, param_cpu)
    for rank in res:
        for precision, r in rank.items():
            cpu, nvme = r["losses"]
            assert cpu == nvme, (stage, precision, cpu, nvme)  # exact: the same arithmetic
            assert r["same_weights"], (stage, precision)
            rep, cpu_rep = r["report"], r["cpu_report"]
            # really on disk: the host holds no master or optimizer state, only the 2 buffers
            assert rep["master_params"] == rep["optimizer_states"] == 0, rep
            assert cpu_rep["master_params"] > 0 and cpu_rep["optimizer_states"] > 0
            assert rep["nvme_offloaded"] == cpu_rep["master_params"] + cpu_rep["optimizer_states"]
            assert rep["nvme_buffers"] == sum(r["buffers"]) and len(r["buffers"]) == 2
            assert max(r["buffers"]) <= r["swap_bytes"]  # a buffer is one group's file, not the whole state
            assert r["files"] and all(f.endswith(".swap") for f in r["files"])
            assert r["left_after_destroy"] == []  # the swap files and the lock are gone


@pytest.mark.parametrize(("stage", "sub_group_size"), [(2, 3000), (3, 1_000_000_000)])
def test_checkpoint_with_nvme_state_resumes_exactly(pool2, tmp_path, stage, sub_group_size):
    """At stage 2 the groups are cut into sub-groups: a save reads every piece, a load writes them back."""
    res = pool2.run("nvme_cases:checkpoint_resume", stage, "bf16", str(tmp_path / "ckpt"), sub_group_size)
    for r in res:
        assert r["resumed"] == r["straight"], r  # another nvme_path, the step's state (not a stale file)
        assert r["resharded"] == r["straight"], r  # into CPU offload at another stage
    assert res[0]["consolidated"] is True  # consolidate: the saved state is CPU offload's
    for r in res:  # the save streamed: each group read once, the one before dropped, the same file bytes
        s = r["streamed"]
        assert s["reads"] > 1 and s["groups_once"] and s["previous_dropped"] and not s["left"], s
        assert s["same_bytes"], s  # as the save that read the whole state first wrote them


def test_swap_file_faults_and_the_lock(pool1, tmp_path):
    out = pool1.run("nvme_cases:faults", str(tmp_path))[0]
    assert out["second_engine"] == "rank0 rank0.1", out  # another engine of this process: its own folder
    assert "group00000.swap" in out["truncated"] and "ends at byte" in out["truncated"], out
    assert ".swap: swap file fails its checksum" in out["changed"], out
    assert ".swap: swap file fails its checksum" in out["save_changed"], out  # the streamed save's read
    assert out["save_left"] == "(False, None)", out
    assert out["left"] == "[]", out


@pytest.mark.parametrize(("stage", "precision", "tp"), [(0, "bf16", 1), (1, "fp16", 1), (2, "bf16_states", 1),
                                                        (3, "bf16", 1), (1, "bf16", 2)])
def test_offload_states_then_reload_is_bit_equal(pool2, stage, precision, tp):
    """engine.offload_states() / reload_states() (DeepSpeed 0.16+): the next steps equal never offloading."""
    for r in pool2.run("nvme_cases:offload_reload", stage, precision, tp):
        assert r["resumed"] == r["straight"], r
        assert "reload_states() before the next forward" in r["refused"], r["refused"]
        before, during, after = r["before"], r["during"], r["after"]
        dropped = before["comm_buffers"] - during["comm_buffers"]  # contiguous_grad_buffer: let go, not copied
        assert during["offloaded_states"] > 0
        assert during["total"] == before["total"] - during["offloaded_states"] - dropped, (before, during)
        for key in ("optimizer_states", "params", "grads"):
            assert during[key] < before[key] or before[key] == 0, (key, before, during)
        assert "offloaded_states" not in after and after["total"] >= before["total"] - before["comm_buffers"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_parameters_on_nvme_are_cpu_parameter_offload_to_the_bit(pool1, pool2, tmp_path, ranks):
    """offload_param.device nvme (stage 3): one rank reads ahead on the reader thread, two read at the prefetch."""
    res = (pool1 if ranks == 1 else pool2).run("nvme_cases:params_on_nvme", str(tmp_path / "ckpt"))
    for r in res:
        assert r["nvme_cpu"] == r["cpu"] and r["nvme_nvme"] == r["cpu"], r
        assert r["resumed"] == r["cpu"][2:], r  # saved with NVMe parameters, loaded on another nvme_path
        rep = r["report"]
        assert r["store_bytes"] == 0 and r["param_files"] > 0, r
        assert rep["master_params"] == 0 and rep["nvme_offloaded"] > rep["nvme_param_offloaded"], rep
        assert rep["nvme_param_offloaded"] == r["param_file_bytes"] > 0, (rep, r)
        assert 0 < rep["nvme_param_buffers"] <= 2 * 3000 * 2 + 2 * 4096, rep  # buffer_count 2 of 3000 bf16 elements
        if ranks == 1:  # one rank reads ahead on the reader thread (several: at the prefetch, reads_ahead_of_gather)
            assert 0 < r["reads"]["ahead"] <= r["reads"]["reads"], r["reads"]
        assert r["left"] == [], r


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_states_with_sequence_parallelism(pool2, stage):
    for r in pool2.run("nvme_cases:sp_offload_reload", stage):
        assert r["offloaded"] == r["straight"] and len(r["straight"]) > 1, r


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_states_with_expert_parallelism(pool2, stage):
    for r in pool2.run("nvme_cases:ep_offload_reload", stage):
        assert r["offloaded"] == r["straight"] and len(r["straight"]) == 3, r


@pytest.mark.parametrize(("stage", "sub_group_size"), [(2, 1_000_000_000), (3, 3000)])
def test_an_edit_of_the_parameters_reaches_the_swapped_master(pool2, stage, sub_group_size):
    """At stage 3 in sub-groups: the edit is written into every piece's file."""
    for r in pool2.run("nvme_cases:edit_then_train", stage, sub_group_size):
        assert r["nvme"] == r["cpu"] and len(r["cpu"]) == 3, r
        assert r["cpu"][1] != r["unedited"][1], r  # the edit took effect


def test_a_client_deepspeed_cpu_adam_steps_through_nvme(pool2):
    for r in pool2.run("nvme_cases:client_deepspeed_adam"):
        assert r["nvme"] == r["cpu"] and r["nvme_swapped"] and not r["cpu_swapped"], r


@pytest.mark.parametrize(("stage", "precision"), [(2, "bf16"), (3, "fp16"), (1, "bf16_states")])
def test_sub_groups_and_no_host_gradient_are_cpu_offload_to_the_bit(pool2, stage, precision):
    """``sub_group_size`` cuts a group into pieces (one file and one buffer's worth each; a 16-bit master's
    through its own fp32 window); gradients are never held on the host; over two micro-batches a step with
    clipping, the losses, norm and weights are CPU offload's to the bit."""
    for r in pool2.run("nvme_cases:sub_groups", stage, precision, 3000):
        assert r["losses"][0] == r["losses"][1] and r["norms"][0] == r["norms"][1], r["losses"]
        assert r["same_weights"]
        assert len(r["pieces"]) > len(r["groups"]) and max(n for _, n in r["pieces"]) <= 3000
        assert sum(n for _, n in r["pieces"]) == sum(r["groups"])
        # by construction: two buffers of one piece's file and its gradient slot, and the norm's staging
        slot = 4096 * -(-max(n for _, n in r["pieces"]) * r["element"] // 4096)
        assert r["per_buffer"] == max(r["file_bytes"]) + slot
        assert r["nvme_buffers"] == 2 * r["per_buffer"] + r["staging"]
        assert r["staging"] == 4096 * -(-max(r["groups"]) * r["element"] // 4096)
        assert not any(r["host_grads"])


def test_openrlhf_sleep_and_wake_through_the_facade_optimizer(pool2):
    """``engine.optimizer.offload_states`` / ``reload_states`` (where RL frameworks call them) and
    ``engine.config[...]`` subscripts (OpenRLHF reads the offload device so), NVMe against CPU offload."""
    for r in pool2.run("nvme_cases:openrlhf_sleep_wake"):
        assert r["nvme"] == r["cpu"] and len(r["cpu"]) == 3, r
        assert (r["cpu_config"], r["nvme_config"]) == ("cpu", "nvme"), r
        assert "reload_states() before the next forward" in r["nvme_refused"], r
