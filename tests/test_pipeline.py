"""Pipeline parallelism (shardwise/pipeline/): DeepSpeed's PipelineModule scripts on the rank pools,
against the same layers trained in one process with plain PyTorch (tests/pipeline_cases.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pipeline_cases as pc
import pytest
import torch


def _check(results: list[dict], ref: dict, exact: bool = True) -> None:
    """Every rank reports the reference's losses (train_batch's, then eval_batch's on another batch);
    every layer's final weights are the reference's
    (bit for bit with ``exact``, else within 1e-5 relative), and together the ranks hold every layer."""
    close = {} if exact else {"rtol": 1e-5, "atol": 1e-7}
    for r in results:
        if exact:
            assert r["losses"] == ref["losses"] and r["eval"] == ref["eval"], (r["losses"], r["eval"], ref)
        else:
            torch.testing.assert_close(torch.tensor(r["losses"] + [r["eval"]]),
                                       torch.tensor(ref["losses"] + [ref["eval"]]), rtol=1e-5, atol=0)
        for name, value in r["weights"].items():
            if exact:
                assert torch.equal(value, ref["params"][name]), name
            else:
                torch.testing.assert_close(value, ref["params"][name], **close)
    assert set().union(*(r["weights"] for r in results)) == set(ref["params"])


@pytest.mark.parametrize("stages", [1, 2])
def test_pp_on_two_ranks_gives_plain_pytorch_losses(pool2, stages: int) -> None:
    results = pool2.run("pipeline_cases:train", stages)
    _check(results, pc.reference(dp=2 // stages))
    assert [r["stage"] for r in results] == ([0, 0] if stages == 1 else [0, 1])
    # comm_stats() counts every transfer: per micro-batch 8 B (header length) + 40 B (header) + 64 B (2 x 8
    # fp32), forward in 3 x 4 training and 4 eval micro-batches, backward in the 12 training ones
    acts, grads = 16 * 112, 12 * 112
    want = [(0, 0), (0, 0)] if stages == 1 else [(acts, grads), (grads, acts)]
    assert [(r["send"], r["recv"]) for r in results] == want


@pytest.mark.parametrize("stages", [4, 2])
def test_pp_and_pp_x_dp_on_four_ranks(pool4, stages: int) -> None:
    """PP 4 (one rank a stage), PP 2 x DP 2: the ranks of a stage are consecutive (DeepSpeed's numbering)."""
    results = pool4.run("pipeline_cases:train", stages)
    _check(results, pc.reference(dp=4 // stages))
    assert [r["stage"] for r in results] == ([0, 1, 2, 3] if stages == 4 else [0, 0, 1, 1])
    assert results[0]["parts"] == ([0, 2, 4, 6, 7] if stages == 4 else [0, 4, 7])


@pytest.mark.parametrize("partition", ["uniform", "type:block"])
def test_partition_methods(pool2, partition: str) -> None:
    results = pool2.run("pipeline_cases:train", 2, partition=partition, steps=2)
    _check(results, pc.reference(dp=1, steps=2))
    assert results[0]["parts"] == ([0, 4, 7] if partition == "uniform" else [0, 3, 7])  # DeepSpeed's (fixture)


def test_activation_checkpointing_and_zero1_and_gpipe(pool2) -> None:
    config = {"zero_optimization": {"stage": 1}, "pipeline": {"schedule": "gpipe"}}
    results = pool2.run("pipeline_cases:train", 2, config=config, interval=2, steps=2)
    _check(results, pc.reference(dp=1, steps=2))


@pytest.mark.parametrize("stages", [1, 2])
def test_tied_layers_across_stages(pool2, stages: int) -> None:
    results = pool2.run("pipeline_cases:train", stages, tied=True)
    _check(results, pc.reference(dp=2 // stages, tied=True))  # the tied gradient summed in one process's order


DS_FIXTURE = json.loads((Path(__file__).parent / "data" / "pipeline" / "ds_losses.json").read_text())


def test_deepspeed_scripts_give_deepspeeds_losses(pool4) -> None:
    """The cases of pipeline_cases.DS_CASES, written as DeepSpeed scripts (``import deepspeed``), give the
    losses and partitions DeepSpeed 0.19.8 gave on 4 gloo ranks (tests/data/pipeline/make_fixture.py)."""
    assert DS_FIXTURE["deepspeed"] == "0.19.8" and set(DS_FIXTURE["cases"]) == set(pc.DS_CASES)
    results = pool4.run("pipeline_cases:ds_fixture_cases", sorted(pc.DS_CASES))
    for name, want in DS_FIXTURE["cases"].items():
        for r in results:
            got = r[name]
            assert got["parts"] == want["parts"], name
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_tuples_cross_the_stages(pool4) -> None:
    """(activations, an integer mask, a float that needs no gradient) between each of 4 stages: gradients
    flow back for the first only, bit for bit."""
    _check(pool4.run("pipeline_cases:train", 4, tied="tuple", partition="uniform"), pc.reference(dp=1, tied="tuple"))


ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # every parameter sharded


@pytest.mark.parametrize("config", [{"zero_optimization": {"stage": 2}}, ZERO3], ids=["zero2", "zero3"])
def test_pp_with_zero2_and_zero3(pool2, config: dict) -> None:
    """Beyond DeepSpeed (which asserts): ZeRO-2/3 on each stage's data-parallel group, bit for bit."""
    _check(pool2.run("pipeline_cases:train", 2, config=config), pc.reference(dp=1))


@pytest.mark.parametrize("config", [{"zero_optimization": {"stage": 2}}, ZERO3], ids=["zero2", "zero3"])
def test_pp_x_dp_zero2_zero3_reduce_once_per_batch(pool4, config: dict) -> None:
    """PP 2 x DP 2 at ZeRO-2/3: each micro-batch's gradients accumulate in the stage's full local bucket and
    are reduce-scattered once per batch, after the last micro-batch: the reference's order (each replica's
    micro-batches summed, then the replicas). ZeRO-3 (a group per layer) gives plain PyTorch's weights bit for
    bit; ZeRO-2 gives ZeRO-1's (the same whole-stage flat shard) bit for bit. The per-micro-batch path
    (reduce-scatter into the shard after each) sums in another order: within tolerance.py's floor.
    comm_stats() counts one reduce-scatter per group per batch and, at ZeRO-3 (held gathered across
    micro-batches), one all-gather per group per batch; per micro-batch: one (two) per micro-batch."""
    from tolerance import EPS32, ULPS_PER_STEP

    steps, gas = 3, pc.CONFIG["gradient_accumulation_steps"]
    once = pool4.run("pipeline_cases:train", 2, config=config, steps=steps)
    if config is ZERO3:
        _check(once, pc.reference(dp=2, steps=steps))
    else:
        zero1 = pool4.run("pipeline_cases:train", 2, config={"zero_optimization": {"stage": 1}}, steps=steps)
        for r, z1 in zip(once, zero1, strict=True):
            assert r["losses"] == z1["losses"] and r["eval"] == z1["eval"]
            assert all(torch.equal(v, z1["weights"][n]) for n, v in r["weights"].items())
    per_micro = pool4.run("pipeline_cases:train", 2, config=config, steps=steps, reduce_once=False)
    rtol = ULPS_PER_STEP * EPS32 * steps
    for r, pm in zip(once, per_micro, strict=True):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(pm["losses"]), rtol=rtol, atol=0)
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, pm["weights"][name], rtol=rtol, atol=1e-7)
        assert r["calls"]["reduce_scatter"] == steps * r["groups"], (r["calls"], r["groups"])
        assert pm["calls"]["reduce_scatter"] == steps * gas * r["groups"], (pm["calls"], r["groups"])
        if config is ZERO3:
            assert r["calls"]["all_gather"] == steps * r["groups"], (r["calls"], r["groups"])
            assert pm["calls"]["all_gather"] == 2 * steps * gas * r["groups"], pm["calls"]


@pytest.mark.parametrize(("zero", "interval"), [(0, 0), (3, 0), (0, 1)], ids=["zero0", "zero3", "checkpointing"])
def test_interleaved_1f1b_equals_1f1b(pool2, zero: int, interval: int) -> None:
    """Interleaved 1F1B, 2 chunks per rank (virtual stages 0 and 2 on rank 0, 1 and 3 on rank 1): every chunk
    runs its backwards in micro-batch order, so the losses and weights are 1F1B's (and plain PyTorch's) bit
    for bit, at ZeRO-0, at ZeRO-3 (reduced once per batch, held gathered across the m x v backwards) and
    with activation checkpointing inside each chunk."""
    config = {"pipeline": {"schedule": "interleaved_1f1b"}, **(ZERO3 if zero == 3 else {})}
    results = pool2.run("pipeline_cases:train", 2, config=config, virtual=2, steps=2, interval=interval)
    _check(results, pc.reference(dp=1, steps=2))
    assert all(len(r["parts"]) == 5 for r in results)


@pytest.mark.parametrize("tied", [True, "three"], ids=["first_and_last", "three_uses"])
def test_interleaved_1f1b_with_tied_layers(pool2, tied) -> None:
    """Interleaved 1F1B (2 chunks a rank: virtual stages 0 and 2 on rank 0, 1 and 3 on rank 1) with a weight
    tied across ranks and chunks: ``True``, layers 0 and 7 (rank 0 chunk 0, rank 1 chunk 1); ``three``, layers
    0, 5 and 7 (rank 0 chunks 0 and 1, rank 1 chunk 1; under 1F1B stage 0 and twice stage 1). The owner sums
    each micro-batch's gradient over the uses in one process's order: plain PyTorch's losses and weights bit
    for bit, so 1F1B's (run here for ``three``; for ``True`` in test_tied_layers_across_stages)."""
    config = {"pipeline": {"schedule": "interleaved_1f1b"}}
    results = pool2.run("pipeline_cases:train", 2, config=config, virtual=2, steps=2, tied=tied)
    assert results[0]["parts"] == [0, 2, 4, 6, 8]
    ref = pc.reference(dp=1, steps=2, tied=tied)
    _check(results, ref)
    if tied == "three":
        _check(pool2.run("pipeline_cases:train", 2, steps=2, tied=tied), ref)


def test_interleaved_tied_copies_on_two_ranks(pool4) -> None:
    """PP 4 with 2 chunks a rank (one layer a virtual stage): the weight used by layers 0, 5 and 7 is owned
    by rank 0 (chunk 0) and copied on ranks 1 and 3 (chunk 1 each), neither next to the owner in the ring
    order of its use: every copy's gradient reaches the owner per micro-batch, plain PyTorch bit for bit."""
    config = {"pipeline": {"schedule": "interleaved_1f1b"}}
    results = pool4.run("pipeline_cases:train", 4, config=config, virtual=2, steps=2, tied="three", partition="uniform")
    assert results[0]["parts"] == list(range(9))
    _check(results, pc.reference(dp=1, steps=2, tied="three"))


def test_tied_gradients_once_a_batch_give_deepspeeds_bits(pool4) -> None:
    """``engine.set_tied_exact(False)``: each copy's gradient sent once a batch (DeepSpeed's traffic) gives
    DeepSpeed 0.19.8's own PP 2 x DP 2 losses bit for bit (its all-reduce adds the stages' sums in the same
    order); the default (per micro-batch, one process's order) is within 1e-5 of them (the fixture test)."""
    for r in pool4.run("pipeline_cases:train", 2, tied=True, facade=True, tied_exact=False):
        assert r["losses"] == DS_FIXTURE["cases"]["pp2_tied"]["losses"]


def test_interleaved_pp_x_dp_zero3(pool4) -> None:
    """Interleaved 1F1B at PP 2 x DP 2 and ZeRO-3: plain PyTorch's losses and weights bit for bit, one
    reduce-scatter and one all-gather per group per batch over the m x v backwards."""
    config = {"pipeline": {"schedule": "interleaved_1f1b"}, **ZERO3}
    results = pool4.run("pipeline_cases:train", 2, config=config, virtual=2, steps=2)
    _check(results, pc.reference(dp=2, steps=2))
    for r in results:
        assert r["calls"] == {"reduce_scatter": 2 * r["groups"], "all_gather": 2 * r["groups"]}, r["calls"]


def test_pp_x_dp_zero3_with_tied_layers(pool4) -> None:
    """PP 2 x DP 2 at ZeRO-3, the tied weight sharded on both stages: gathered to be sent after each step.
    Measured: the losses, the eval loss and the tied weight bit for bit; one element of 5.fc.bias 1 ulp off
    (3.7e-9), which ZeRO-3 on these ranks gives without ties too at another stage3_param_persistence_threshold
    (it moves where each parameter sits in the flat shard)."""
    results = pool4.run("pipeline_cases:train", 2, config=ZERO3, tied=True)
    ref = pc.reference(dp=2, tied=True)
    _check(results, ref, exact=False)
    for r in results:
        assert r["losses"] == ref["losses"] and r["eval"] == ref["eval"], r["losses"]
        assert torch.equal(r["weights"]["tied_modules.proj.weight"], ref["params"]["tied_modules.proj.weight"])


@pytest.mark.parametrize(("save", "load", "tied"),
                         [(2, 1, False), (1, 2, False), (1, 2, True), (2, 2, True), (2, 1, True)])
def test_checkpoint_resumes_at_another_pp_degree(pool2, tmp_path, save: int, load: int, tied: bool) -> None:
    """ZeRO-1, saved after 2 batches at ``save`` stages, resumed at ``load`` stages on the same ranks (so the
    data-parallel degree changes too): batches 3-4 are the single-process run's with that change, bit for bit
    (DeepSpeed's PP 2 checkpoint fails to load at PP 1 and PP 4)."""
    ref = pc.reference(dp=[2 // save] * 2 + [2 // load] * 2, steps=4, tied=tied)["losses"][2:]
    for _, resumed in pool2.run("pipeline_cases:resume", save, load, str(tmp_path / "ckpt"), tied=tied):
        assert resumed == ref


def test_interleaved_checkpoint_resumes_under_1f1b(pool2, tmp_path) -> None:
    """Saved under interleaved 1F1B (2 chunks a rank, ZeRO-1), resumed at 2 stages under 1F1B: the
    single-process run's losses bit for bit (tensors are named by global layer index)."""
    ref = pc.reference(dp=1, steps=4)["losses"][2:]
    for uninterrupted, resumed in pool2.run("pipeline_cases:resume", 2, 2, str(tmp_path / "ckpt"), save_virtual=2):
        assert resumed == ref and uninterrupted == ref


def test_checkpoint_from_four_stages_resumes_at_two(pool4, tmp_path) -> None:
    ref = pc.reference(dp=[1, 1, 2, 2], steps=4)["losses"][2:]
    for uninterrupted, resumed in pool4.run("pipeline_cases:resume", 4, 2, str(tmp_path / "ckpt")):
        assert resumed == ref and uninterrupted == pc.reference(dp=1, steps=4)["losses"][2:]


def test_training_data_given_to_initialize(pool2) -> None:
    for from_loader, from_iterator in pool2.run("pipeline_cases:train_from_dataset", 2):
        assert from_loader == from_iterator


def test_schedules_and_partitions_in_process() -> None:
    """1F1B: stage s of p runs p-s-1 forwards first, every backward in micro-batch order, at most p-s
    micro-batches in flight; GPipe: all forwards first. Partitions: DeepSpeed's cuts (its ties included)."""
    from shardwise.errors import UsageError
    from shardwise.pipeline import bubble_fraction, partition_balanced, partition_uniform
    from shardwise.pipeline.schedule import train_steps

    p, m = 4, 8
    for s in range(p):
        steps = train_steps("1f1b", m, p, s)
        assert steps[: p - s - 1] == [("F", i) for i in range(p - s - 1)]
        assert [i for k, i in steps if k == "B"] == list(range(m)) == [i for k, i in steps if k == "F"]
        flight = [sum(1 if k == "F" else -1 for k, _ in steps[: j + 1]) for j in range(len(steps))]
        assert max(flight) == p - s and min(flight) >= 0
    assert train_steps("gpipe", 3, 2, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert partition_uniform(7, 2) == [0, 4, 7] and partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    assert partition_balanced([1, 1, 1, 1, 1, 1, 0], 2) == [0, 3, 7]
    assert partition_balanced([72] * 7, 4) == [0, 2, 4, 6, 7]
    assert bubble_fraction(4, 8) == 3 / 11 and bubble_fraction(4, 8, virtual=2) == 3 / 19
    # interleaved (p=4, v=2, m=8): each (micro-batch, chunk) once forward and once backward, forward first;
    # each chunk's backwards in micro-batch order; the last step is chunk 0's last backward (the boundary)
    for s in range(p):
        steps = train_steps("interleaved_1f1b", m, p, s, virtual=2)
        fwd, bwd = [st[1:] for st in steps if st[0] == "F"], [st[1:] for st in steps if st[0] == "B"]
        assert sorted(fwd) == sorted(bwd) == sorted((i, c) for i in range(m) for c in range(2))
        assert all(steps.index(("F", i, c)) < steps.index(("B", i, c)) for i, c in fwd)
        assert all([i for i, c2 in bwd if c2 == c] == list(range(m)) for c in range(2))
        assert steps[-1] == ("B", m - 1, 0)
    with pytest.raises(UsageError, match="divisible by the 4 stages"):
        train_steps("interleaved_1f1b", 6, 4, 0, virtual=2)


@pytest.mark.parametrize("config", [
    {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
    {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                      "offload_param": {"device": "cpu"}}},
], ids=["bf16-zero1", "bf16-zero3-offload"])
def test_bf16_and_offload_equal_the_run_without_pp(pool1, pool2, config: dict) -> None:
    """Beyond DeepSpeed: bf16 and offload at PP 2 give what the same engine gives without stages (PP 1 on one
    rank), bit for bit: the stages run the same ops and hand each other bf16 activations and gradients."""
    alone = pool1.run("pipeline_cases:train", 1, config=config)[0]
    for r in pool2.run("pipeline_cases:train", 2, config=config):
        assert r["losses"] == alone["losses"] and r["eval"] == alone["eval"]
        for name, value in r["weights"].items():
            assert torch.equal(value, alone["weights"][name]), name


def test_estimate_pp_is_one_stage_and_the_bubble(capsys) -> None:
    """`shardwise estimate --pp 2`: the report of one stage (half the parameters on half the devices) and
    the bubble; devices that tp x pp does not divide: exit 2."""
    import json

    from shardwise.cli.estimate import main
    from shardwise.estimate import estimate

    assert main(["--params", "7B", "--devices", "16", "--pp", "2", "--micro-batches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pipeline"]["bubble"] == 1 / 9 and out["pipeline"]["stages"] == 2
    assert out["stages"]["1"]["per_device_bytes"] == estimate(3_500_000_000, 8).stages[1].per_device_bytes
    assert main(["--params", "7B", "--devices", "15", "--pp", "2"]) == 2
    assert "not divisible by --tp 1 x --pp 2" in capsys.readouterr().err
