"""Pipeline parallelism composed with tensor and sequence parallelism (docs/pipeline.md, "Composition"):
PP 2 x TP 2 and PP 2 x SP 2 on the 4-rank pool against the same run without stages (TP 2 / SP 2 on
the 2-rank pool: the same degree and global batch), bit for bit, and against the unsplit layers on one
rank within the suite's 1e-5 (tests/pipeline_compose_cases.py)."""

from __future__ import annotations

import pytest
import torch
from tolerance import EPS32, ULPS_PER_STEP

OFFLOAD_FP32 = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
OFFLOAD_BF16 = {"bf16": {"enabled": True}, "zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
BF16_STATES = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
MODES = [OFFLOAD_FP32, OFFLOAD_BF16, BF16_STATES]
MODE_IDS = ["fp32_zero1_offload", "bf16_zero3_offload", "bf16_states_zero2_offload"]
EP2 = {"expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}}
TP2 = {"tensor_parallel": {"autotp_size": 2}}


def _same(split: list[dict], whole: list[dict], key: str) -> None:
    """Every rank of the pipelined run holds the run without stages' numbers for its coordinate (``key``:
    its TP or SP rank) bit for bit: losses, eval loss and each of its layers' weights."""
    by_coord = {r[key]: r for r in whole}
    for r in split:
        ref = by_coord[r[key]]
        assert (r["losses"], r["eval"]) == (ref["losses"], ref["eval"]), (r["stage"], r["losses"], ref["losses"])
        for name, value in r["weights"].items():
            assert torch.equal(value, ref["weights"][name]), (r["stage"], r[key], name)
    for coord in by_coord:  # together the stages hold every layer
        held = set().union(*(r["weights"] for r in split if r[key] == coord))
        assert held == set(by_coord[coord]["weights"]), coord


def _near_unsplit(split: list[dict], unsplit: dict) -> None:
    """The losses of the split run are the unsplit layers' within 1e-5 relative (TP's partial sums and
    SP's shard means are added in another order)."""
    for r in split:
        torch.testing.assert_close(torch.tensor(r["losses"] + [r["eval"]]),
                                   torch.tensor(unsplit["losses"] + [unsplit["eval"]]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("config", MODES, ids=MODE_IDS)
def test_pp2_x_tp2_equals_tp2_without_stages(pool1, pool2, pool4, config: dict) -> None:
    split = pool4.run("pipeline_compose_cases:train", "tp", 2, tp=2, config=config)
    whole = pool2.run("pipeline_compose_cases:train", "tp", 1, tp=2, config=config)
    # the one grid, pp x dp x tp: ranks 0-1 stage 0, 2-3 stage 1; TP innermost; each TP rank's pipe peer
    # has its TP coordinate
    assert [(r["stage"], r["tp_rank"]) for r in split] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["pipe"] for r in split] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # DeepSpeed's getters hand out the same groups: pipe, data (a rank alone), model
    assert [r["groups"] for r in split] == [[[0, 2], [0], [0, 1]], [[1, 3], [1], [0, 1]],
                                            [[0, 2], [2], [2, 3]], [[1, 3], [3], [2, 3]]]
    assert all(r["dp_world"] == 1 for r in split + whole)
    _same(split, whole, "tp_rank")
    assert all(r["send"] > 0 and r["all_reduce"] > 0 for r in split)  # the wire and TP's all-reduces counted
    if "bf16" not in config:
        _near_unsplit(split, pool1.run("pipeline_compose_cases:train", "tp", 1, config=config)[0])


@pytest.mark.parametrize("config", MODES, ids=MODE_IDS)
def test_pp2_x_sp2_equals_sp2_without_stages(pool1, pool2, pool4, config: dict) -> None:
    split = pool4.run("pipeline_compose_cases:train", "sp", 2, sp=2, config=config)
    whole = pool2.run("pipeline_compose_cases:train", "sp", 1, sp=2, config=config)
    assert [(r["stage"], r["sp_rank"]) for r in split] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["pipe"] for r in split] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # SP ranks are data ranks to ZeRO: the stage's data group holds both
    assert [r["groups"][1] for r in split] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r["dp_world"] == 1 for r in split + whole)  # the two SP ranks read one sample set
    _same(split, whole, "sp_rank")
    assert all(r["all_to_all"] > 0 for r in split)  # the sequence exchange counted in comm_stats()
    if "bf16" not in config:
        _near_unsplit(split, pool1.run("pipeline_compose_cases:train", "sp", 1, config=config)[0])


def test_what_is_not_served_is_one_line(pool4) -> None:
    got = pool4.run("pipeline_compose_cases:refused", {"tensor_parallel": {"autotp_size": 2}})
    assert all("PipeModelDataParallelTopology(num_pp, num_mp=2" in g and "\n" not in g for g in got), got
    got = pool4.run("pipeline_compose_cases:refused", {"sequence_parallel_size": 2}, stages=1, tp=2)
    assert all("sequence_parallel_size > 1 beside a model-parallel size > 1" in g for g in got), got
    got = pool4.run("pipeline_compose_cases:refused", {"expert_parallel": {"enabled": True, "autoep_size": 2}})
    assert all("expert_parallel.enabled beside a PipelineModule of the script's own layers" in g for g in got), got


@pytest.mark.parametrize(("config", "reduce_once"), [(OFFLOAD_FP32, True), (OFFLOAD_BF16, False), (BF16_STATES, False)],
                         ids=MODE_IDS)
def test_pp2_x_ep2_equals_ep2_without_stages(pool2, pool4, config: dict, reduce_once: bool) -> None:
    """A Mixtral-style MoE model split by ``pipeline.stages`` 2 with ``expert_parallel.autoep_size`` 2 on 4
    ranks (each stage: EP 2, its 2 experts of 4 per rank) against EP 2 on 2 ranks through the engine's own
    loop, the same micro-batches: the same losses and weights, bit for bit. At ZeRO-3 the engine's loop
    reduce-scatters after every micro-batch, so the pipeline is asked to (``set_reduce_once(False)``): its
    default, once per batch, adds the bf16 gradients in another order (docs/pipeline.md)."""
    split = pool4.run("pipeline_compose_cases:train_hf", "mixtral", 2, EP2, config=config, reduce_once=reduce_once)
    whole = pool2.run("pipeline_compose_cases:train_hf", "mixtral", 1, EP2, config=config)
    ref = whole[0]
    assert all(r["ep_world"] == 2 and r["all_to_all"] > 0 for r in split + whole)
    assert [r["stage"] for r in split] == [0, 0, 1, 1]
    for r in split:
        assert r["losses"] == ref["losses"], (r["losses"], ref["losses"])
        for name, value in r["weights"].items():
            assert torch.equal(value, ref["weights"][name]), name
    assert set(split[0]["weights"]) | set(split[2]["weights"]) == set(ref["weights"])
    assert set(split[0]["weights"]).isdisjoint(split[2]["weights"])


def test_hf_model_split_by_stages_with_autotp(pool2, pool4) -> None:
    """``pipeline.stages`` 2 with ``tensor_parallel.autotp_size`` 2 on a Llama (4 ranks): sliced by its own TP
    plan over each stage's TP group, then cut; against TP 2 without stages on 2 ranks (the engine's loop, same
    micro-batches). The run without stages takes its loss vocabulary-parallel, the stages from the gathered
    logits, so they agree within the suite's floor (32 ulps a step; measured 8e-8 on the losses, 8e-7 of a
    weight's largest element), under SGD, whose update is proportional to the gradient."""
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
    split = pool4.run("pipeline_compose_cases:train_hf", "llama", 2, TP2, config=sgd)
    whole = pool2.run("pipeline_compose_cases:train_hf", "llama", 1, TP2, config=sgd)
    floor = ULPS_PER_STEP * EPS32 * 3
    assert [r["stage"] for r in split] == [0, 0, 1, 1] and all(r["tp_world"] == 2 for r in split)
    for rank, r in enumerate(split):  # stage rank // 2, TP rank rank % 2: the same slices as TP rank rank % 2
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(whole[0]["losses"]), rtol=floor, atol=0)
        ref = whole[rank % 2]["weights"]
        for name, value in r["weights"].items():
            assert float((value - ref[name]).abs().max()) <= floor * float(ref[name].abs().max()), name
    assert set(split[0]["weights"]) | set(split[2]["weights"]) == set(whole[0]["weights"])
    assert all(r["all_reduce"] > 0 for r in split)  # TP's all-reduces counted in comm_stats()


def test_hf_split_refusals(pool2, pool4) -> None:
    got = pool4.run("pipeline_compose_cases:hf_refused", {"sequence_parallel_size": 2})
    assert all(g.startswith("UsageError: pipeline.stages with sequence_parallel_size > 1") for g in got), got
    got = pool2.run("pipeline_compose_cases:hf_refused", {}, aux=True)
    assert all("router auxiliary loss" in g and "\n" not in g for g in got), got


def test_checkpoints_resume_and_reshard(pool4, tmp_path) -> None:
    """PP 2 x TP 2 and PP 2 x SP 2 (ZeRO-1) saved halfway resume with the uninterrupted losses bit for bit;
    PP 2 x TP 2's checkpoint loaded at PP 1 x TP 2 x DP 2 and at PP 2 x DP 2 (no TP) gives the saving run's
    eval loss bit for bit (every slice where it belongs)."""
    for kind, tp, sp in (("tp", 2, 1), ("sp", 1, 2)):
        got = pool4.run("pipeline_compose_cases:resume", kind, str(tmp_path / kind), tp=tp, sp=sp)
        assert all(straight == resumed for straight, resumed in got), (kind, got)
    got = pool4.run("pipeline_compose_cases:reshard", str(tmp_path / "reshard"))
    assert all(len(set(r)) == 1 for r in got) and len({r[0] for r in got}) == 1, got
