"""Stage 3's backward holds no more reduce-scatter memory than is in flight (docs/precision.md, "The peak
of a step"): a bucket fills beside at most one pending reduction, gloo receives a 2-rank reduce-scatter's
chunk straight into the gradient shard; exact byte counts from the model's sizes, and the same bits as
before."""

from __future__ import annotations

import pytest
import torch
from zero_cases import assert_same_bits


@pytest.mark.parametrize(("overlap", "gas", "force"),
                         [(True, 1, ""), (True, 2, ""), (False, 1, ""), (True, 1, "take"), (True, 2, "take")])
def test_stage3_bucket_fills_beside_one_pending_reduction(pool2, overlap, gas, force):
    """At each bucket's first gradient: the filling bucket, the root's, and the previous group's while
    its reduce-scatter is still exchanging. ``force="take"``: every take finds the previous exchange over,
    so ``make_room`` finishes it first and its bucket is the one reused: one layer's bucket, not two."""
    for r in pool2.run("lean_cases:bucket_sequence", overlap, gas, force):
        padded = r["padded"]
        backwards = [[]]
        for i, live, nbytes in r["takes"]:
            if backwards[-1] and i == backwards[-1][0][0]:  # the first group taken again: the next backward
                backwards.append([])
            backwards[-1].append((i, live, nbytes))
        assert len(backwards) == 2 * gas
        for takes in backwards:
            order = [i for i, _, _ in takes]
            assert sorted(order) == list(range(len(padded)))  # every group's bucket, once a backward
            first = order[0]  # the root: its head's gradient comes first, its embedding's last
            for k, (i, live, nbytes) in enumerate(takes):
                # filling: this group and the root; reducing: the group before it, with overlap only
                expect = {first, i}
                maybe = {order[k - 1]} if overlap and k > 1 and force != "take" else set()  # still exchanging
                assert expect <= set(live) <= expect | maybe, (k, live, expect)
                assert nbytes == 2 * sum(padded[j] for j in live), (k, nbytes)  # bf16 buckets
        # 2 ranks: a reduce-scatter into the shard receives into it; only accumulation (the second
        # micro-batch onto a shard) stages the other rank's chunk, one shard's size each
        shard = r["shard"]
        assert sorted(r["buffers"]) == sorted(shard * (gas - 1) * 2), r["buffers"]


@pytest.mark.parametrize(("precision", "overlap", "gas"),
                         [("bf16", True, 2), ("bf16", True, 1), ("bf16", False, 2), ("fp32", True, 1),
                          ("fp32", False, 1)])
def test_stage3_lean_backward_changes_no_bit(pool2, precision, overlap, gas):
    before = pool2.run("lean_cases:train", False, overlap, gas, precision)
    assert_same_bits(before, pool2.run("lean_cases:train", True, overlap, gas, precision))


def test_stage3_lean_backward_changes_no_bit_at_4_ranks(pool4):
    """4 ranks: the shard receives the first other rank's chunk, the other two are staged."""
    before = pool4.run("lean_cases:train", False, True, 2, "bf16")
    assert_same_bits(before, pool4.run("lean_cases:train", True, True, 2, "bf16"))


@pytest.mark.parametrize("gas", [1, 2])
def test_stage3_exchange_over_after_the_take_is_let_go_at_the_next_gradient(pool2, gas):
    """The rank ahead meets its predecessor's exchange unfinished at the take; once it is over, the next
    gradient hook finishes it and lets its bucket go (not kept for reuse through this unit's backward):
    after each such hook the live buckets are the filling ones (a layer's, the root's), and none is kept."""
    for r in pool2.run("lean_cases:bucket_sequence", True, gas, "hook"):
        assert r["finished_at_hooks"] >= 2 * gas * (len(r["padded"]) - 2)  # every layer's but the last
        first = r["takes"][0][0]
        for filling, live, kept in r["hooks"]:
            # (the root's last gradient, the embedding's, comes after the last layer's take: only the root)
            assert first in live and set(live) <= {first, filling}, (filling, live)
            assert kept == 0


@pytest.mark.parametrize(("precision", "overlap", "gas", "early"),
                         [("bf16", True, 2, "take"), ("bf16", True, 1, "take"), ("bf16", False, 2, "take"),
                          ("fp16", True, 1, "take"), ("fp32", True, 1, "take"), ("bf16", True, 2, "hook"),
                          ("fp32", True, 1, "hook")])
def test_stage3_early_finish_changes_no_bit(pool2, precision, overlap, gas, early):
    """A reduction finished at the next take or gradient hook (its exchange over) against the same run
    leaving it pending until ``limit`` are: the same additions, earlier; losses and weights equal bit for bit."""
    before = pool2.run("lean_cases:train_early", "", overlap, gas, precision)
    after = pool2.run("lean_cases:train_early", early, overlap, gas, precision)
    for r in after:
        assert (r.pop("finished_early") > 0) == overlap  # the early path ran (only overlap leaves work pending)
    for r in before:
        assert r.pop("finished_early") == 0
    assert_same_bits(before, after)


@pytest.mark.parametrize("early", ["take", "hook"])
def test_stage3_early_finish_changes_no_bit_with_quantized_gradients(pool2, early):
    """qgZ's reduce-scatter is a work made of an all-to-all: it reports that one's end (``after``)."""
    qgz = {"zero_quantized_gradients": True}
    before = pool2.run("lean_cases:train_early", "", True, 2, "bf16", **qgz)
    after = pool2.run("lean_cases:train_early", early, True, 2, "bf16", **qgz)
    assert all(r.pop("finished_early") > 0 for r in after) and all(r.pop("finished_early") == 0 for r in before)
    assert_same_bits(before, after)


@pytest.mark.parametrize("early", ["take", "hook"])
def test_stage3_early_finish_changes_no_bit_at_4_ranks(pool4, early):
    before = pool4.run("lean_cases:train_early", "", True, 2, "bf16")
    after = pool4.run("lean_cases:train_early", early, True, 2, "bf16")
    assert all(r.pop("finished_early") > 0 for r in after) and all(r.pop("finished_early") == 0 for r in before)
    assert_same_bits(before, after)


def test_gloo_exchange_reports_its_end_once_watched(pool2):
    """The query the early finish relies on, on gloo's own exchange: unwatched it cannot tell (False),
    watched it turns True with the other rank's chunk received and nothing added yet; a work made of
    other works (the rank-order all-reduce) answers False."""
    for rank, r in enumerate(pool2.run("lean_cases:work_completion")):
        other = 1 - rank
        mine = torch.arange(4, dtype=torch.float32) + 4 * rank
        assert r["unwatched"] is False and r["composite"] is False
        assert torch.equal(r["received"], mine + 10 * other)  # the other rank's chunk, received into the shard
        assert torch.equal(r["out"], (mine + 10 * 0) + (mine + 10 * 1))  # the sum in rank order, by wait()


@pytest.mark.parametrize("offload", ["none", "optimizer", "param"])
def test_stage3_fp32_master_is_the_persistent_copy_without_offload(pool2, offload):
    """bf16 with fp32 masters: no 16-bit shard beside the master (2 bytes x Ψ/N less); under offload
    (the master on the host) the 16-bit shard stays, as before."""
    for r in pool2.run("lean_cases:master_store_bytes", offload):
        shard = sum(r["shard"])
        for when in ("built", "stepped"):
            held = r[when]
            lean = offload == "none"
            assert held["master_store"] == [lean] * len(r["shard"])
            assert held["shard_dtype"] == ["torch.float32" if lean else "torch.bfloat16"] * len(r["shard"])
            assert sum(held["store_bytes"]) == (0 if lean else 2 * shard)
            rep = held["report"]
            assert rep["params"] == (0 if lean else 2 * shard)  # every group released
            assert rep["master_params"] == 4 * shard
        assert r["stepped"]["report"]["optimizer_states"] == 8 * shard  # AdamW's two fp32 moments


def test_stage3_master_store_takes_every_write(pool2):
    for r in pool2.run("lean_cases:master_store_edits"):
        assert torch.equal(r["after_edit"], r["edit"])  # rank 0's edit, in every rank's master
        assert torch.equal(r["master"], r["fine"])  # the fp32 value itself, not rounded to bf16
        assert torch.equal(r["gathered"], r["fine"].to(torch.bfloat16))  # a gather rounds it, once


@pytest.mark.parametrize(("precision", "overlap", "gas"),
                         [("bf16", True, 2), ("bf16", False, 1), ("fp16", True, 1), ("fp32", True, 1)])
def test_stage3_master_store_changes_no_bit(pool2, precision, overlap, gas):
    before = pool2.run("lean_cases:train_store", False, overlap, gas, precision)
    lean = pool2.run("lean_cases:train_store", True, overlap, gas, precision)
    for a, b in zip(before, lean, strict=True):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
