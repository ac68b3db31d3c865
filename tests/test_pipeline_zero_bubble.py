"""The zero-bubble schedule (``pipeline.schedule: "zb_h1"``, shardwise/pipeline/split.py, zero_bubble.py): each
backward split into B (the inputs' gradient, sent at once) and W (the weights', deferred), the W's in
micro-batch order, so the losses and weights are 1F1B's and plain PyTorch's bit for bit."""

from __future__ import annotations

import pipeline_cases as pc
import pytest
import torch
from test_pipeline import ZERO3, _check


@pytest.mark.parametrize("zero", [0, 3])
def test_zb_h1_at_two_stages_gives_plain_pytorch(pool2, zero: int) -> None:
    """PP 2 at ZeRO-0 and ZeRO-3 (held gathered through the batch, reduced once, in the last W): the
    single-process losses, eval loss and weights bit for bit."""
    config = {"pipeline": {"schedule": "zb_h1"}, **(ZERO3 if zero == 3 else {})}
    _check(pool2.run("pipeline_cases:train", 2, config=config, steps=2), pc.reference(dp=1, steps=2))


@pytest.mark.parametrize("stages", [2, 4])
def test_zb_h1_with_tied_layers_equals_1f1b(pool2, pool4, stages: int) -> None:
    """A weight tied across the first and the last stage (PP 2, PP 4): its gradient, summed by the owner in its
    last W, is 1F1B's bit for bit (both within 1e-5 of plain PyTorch: the tie's sum order)."""
    pool = pool2 if stages == 2 else pool4
    for zb, f1b in pool.run("zero_bubble_cases:zb_and_1f1b", stages, tied=True, steps=2):
        assert zb["losses"] == f1b["losses"] and zb["eval"] == f1b["eval"]
        assert all(torch.equal(v, f1b["weights"][n]) for n, v in zb["weights"].items())


def test_zb_h1_four_stages_zero1_with_tuples(pool4) -> None:
    """PP 4 at ZeRO-1 with tuples crossing the stages (a float that needs no gradient, an integer mask): plain
    PyTorch's results bit for bit."""
    zero1 = {"pipeline": {"schedule": "zb_h1"}, "zero_optimization": {"stage": 1}}
    _check(pool4.run("pipeline_cases:train", 4, config=zero1, tied="tuple", partition="uniform", steps=2),
           pc.reference(dp=1, tied="tuple", steps=2))


def test_zb_h1_pp_x_dp_zero3_gives_plain_pytorch(pool4) -> None:
    """PP 2 x DP 2 at ZeRO-3 (each stage sharded over its 2 replicas, held gathered through the batch): plain
    PyTorch's results bit for bit, one reduce-scatter and one all-gather per group per batch."""
    results = pool4.run("pipeline_cases:train", 2, config={"pipeline": {"schedule": "zb_h1"}, **ZERO3}, steps=2)
    _check(results, pc.reference(dp=2, steps=2))
    for r in results:
        assert r["calls"] == {"reduce_scatter": 2 * r["groups"], "all_gather": 2 * r["groups"]}, r["calls"]


def test_zb_h1_pp_x_dp_zero2_equals_1f1b(pool4) -> None:
    """PP 2 x DP 2 at ZeRO-2: 1F1B's results bit for bit (which are ZeRO-1's), one reduce-scatter per group
    per batch, as under 1F1B."""
    for zb, f1b in pool4.run("zero_bubble_cases:zb_and_1f1b", 2, {"zero_optimization": {"stage": 2}}, steps=2):
        assert zb["losses"] == f1b["losses"] and zb["eval"] == f1b["eval"]
        assert all(torch.equal(v, f1b["weights"][n]) for n, v in zb["weights"].items())
        assert zb["calls"] == f1b["calls"] and zb["calls"]["reduce_scatter"] == 2 * zb["groups"], zb["calls"]


def test_zb_h1_refusals_are_one_line(pool2) -> None:
    """Activation checkpointing and ZeRO-2's per-micro-batch reduction (2 stages), layers that checkpoint
    themselves reentrantly (1 stage x DP 2, refused in the weight pass): one line on every rank."""
    for checkpointing, per_micro, reentrant in pool2.run("zero_bubble_cases:refusals"):
        assert "activation checkpointing with pipeline.schedule zb_h1 is not served" in checkpointing, checkpointing
        assert "set_reduce_once(False) with pipeline.schedule zb_h1 is not served" in per_micro, per_micro
        assert "UsageError: pipeline.schedule zb_h1 with reentrant activation checkpointing" in reentrant, reentrant
        assert all("\n" not in line for line in (checkpointing, per_micro, reentrant))


def test_zb_h1_schedule_in_process() -> None:
    """Each micro-batch's F, B and W once, B after F, W after B; B's and W's in micro-batch order (1F1B's
    accumulation order); stage s defers s W's, so at most p micro-batches wait for their W on any stage
    (1F1B: p - s); the batch ends with the last W (the boundary). Bubble (p-1)/(3m+p-1)."""
    from shardwise.pipeline import bubble_fraction
    from shardwise.pipeline.schedule import train_steps

    for p, m in ((2, 4), (4, 8), (4, 2)):
        for s in range(p):
            steps = train_steps("zb_h1", m, p, s)
            assert len(steps) == 3 * m and len(set(steps)) == 3 * m
            for kind in "FBW":
                assert [i for k, i in steps if k == kind] == list(range(m))
            assert all(steps.index(("F", i)) < steps.index(("B", i)) < steps.index(("W", i)) for i in range(m))
            held = [sum({"F": 1, "W": -1}.get(k, 0) for k, _ in steps[: j + 1]) for j in range(len(steps))]
            assert max(held) == min(p, m), (p, m, s, steps)
            assert steps[-1] == ("W", m - 1)
    assert bubble_fraction(4, 8, schedule="zb_h1") == 3 / 27


def test_zb_h1_splits_a_hugging_face_llama_as_1f1b(pool2) -> None:
    """An HF Llama split at 2 stages with its embedding tied to the head (attention, RMSNorm and rotary
    embeddings in the split graph; the tie's gradient summed by the owner in its last W): 1F1B's losses and
    weights bit for bit."""
    for (zb_losses, zb_w), (losses, weights) in pool2.run("zero_bubble_cases:lm_zb_and_1f1b", 2, True):
        assert zb_losses == losses
        assert weights and all(torch.equal(v, weights[n]) for n, v in zb_w.items())


def test_estimate_pp_with_the_zero_bubble_schedule(capsys) -> None:
    """`shardwise estimate --pp 2 --schedule zb_h1`: the bubble (p-1)/(3m+p-1); --schedule without --pp: exit 2."""
    import json

    from shardwise.cli.estimate import main

    assert main(["--params", "7B", "--devices", "16", "--pp", "2", "--micro-batches", "8", "--schedule", "zb_h1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["pipeline"]
    assert out["bubble"] == 1 / 25 and out["schedule"] == "zb_h1" and "every stage's activations" in out["line"]
    assert main(["--params", "7B", "--devices", "16", "--schedule", "zb_h1"]) == 2
    assert "--schedule goes with --pp" in capsys.readouterr().err


def test_a_stalled_stage_ends_its_neighbour_at_the_timeout(tmp_path) -> None:
    """Stage 1 hangs (alive) in its first forward: stage 0, waiting for micro-batch 0's gradient, ends at the
    collective timeout (3 s here) with one line naming the stage, its rank and the transfer; stage 1, once
    it moves on, ends with one line naming stage 0. (Under `shardwise launch` or torchrun a rank that
    stays hung is ended by the launcher when its neighbour exits with the error.)"""
    from rank_pool import run_fresh

    (s0, first), (s1, second) = run_fresh(2, "zero_bubble_cases:stalled_stage", str(tmp_path), timeout_s=3, timeout=60)
    assert "StageTransferError: pipeline stage 0 (rank 0) failed receiving the gradients of micro-batch 0" in first
    assert "from stage 1 (rank 1)" in first and "stalled past the timeout" in first and "\n" not in first, first
    assert 3 <= s0 < 20, s0
    assert "StageTransferError: pipeline stage 1 (rank 1) failed" in second and "stage 0 (rank 0)" in second, second
    assert "\n" not in second, second


def test_shardwise_train_pp2_under_zb_h1_exports_1f1bs_weights(pool2, tmp_path) -> None:
    """`shardwise train --pp 2` with the run's DeepSpeed config naming `pipeline.schedule: zb_h1`: the same
    losses and exported weights as under 1F1B, bit for bit."""
    import json

    from safetensors.torch import load_file
    from test_train_pipeline import CFG
    from train_cases import train_in

    runs = {}
    for schedule in ("1f1b", "zb_h1"):
        cfg, out = tmp_path / f"{schedule}.json", tmp_path / schedule
        cfg.write_text(json.dumps({**CFG, "pipeline": {"schedule": schedule}}))
        train_in(pool2, ["--config", str(cfg), "--model", "llama-micro", "--seq", "32", "--steps", "2", "--pp", "2",
                         "--eval-every", "0", "--save-every", "0", "--sample-tokens", "0", "--out", str(out)])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[schedule] = ([r["loss"] for r in rows if r["kind"] == "train"],
                          {k: v for f in sorted((out / "hf").glob("model*.safetensors"))
                           for k, v in load_file(str(f)).items()})  # one shard a stage
    (losses, weights), (zb_losses, zb_weights) = runs["1f1b"], runs["zb_h1"]
    assert len(losses) == 2 and zb_losses == losses
    assert sorted(weights) == sorted(zb_weights) and all(torch.equal(weights[n], zb_weights[n]) for n in weights)


def test_zb_h1_bf16_zero3_offload_equals_1f1b(pool2) -> None:
    """bf16 at ZeRO-3 with optimizer and parameter offload (bf16 gradients folded into the fp32 accumulation
    in each W): 1F1B's losses and weights bit for bit."""
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                               "offload_param": {"device": "cpu"}}}
    for zb, f1b in pool2.run("zero_bubble_cases:zb_and_1f1b", 2, config, steps=2):
        assert zb["losses"] == f1b["losses"] and zb["eval"] == f1b["eval"]
        assert all(torch.equal(v, f1b["weights"][n]) for n, v in zb["weights"].items())


class _Twice(torch.nn.Module):
    """One weight used twice (the W pass starts from two intermediates, one behind the other) and a norm."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.a(self.b(torch.tanh(self.a(x))))) * 2


@pytest.mark.parametrize("first", [False, True], ids=["inner_stage", "first_stage"])
@pytest.mark.parametrize("kind", ["mlp", "twice", "attention", "split_output"])
def test_split_backward_equals_one_backward(kind: str, first: bool) -> None:
    """In one process: B then W (shardwise/pipeline/split.py) give one backward's input and weight gradients
    bit for bit over 3 accumulated micro-batches, for a chain of layers, a weight used twice, an attention
    layer, and two outputs made by one node (a chunk); at a first stage (no input gradient) W does it all.
    No parameter receives anything in B."""
    import copy

    from shardwise.pipeline.split import SplitBackward

    torch.manual_seed(0)
    one = {"mlp": lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)),
           "twice": _Twice, "split_output": lambda: torch.nn.Linear(8, 16),
           "attention": lambda: torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)}[kind]()
    two = copy.deepcopy(one)
    seen: list[int] = []
    for p in two.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: seen.append(1))
    n = len(list(two.parameters()))
    for micro in range(3):
        x = torch.randn(2, 3, 8) if kind == "attention" else torch.randn(4, 8)
        xa, xb = x.clone().requires_grad_(not first), x.clone().requires_grad_(not first)
        outs_a, outs_b = one(xa), two(xb)
        outs_a, outs_b = (outs_a.chunk(2, -1), outs_b.chunk(2, -1)) if kind == "split_output" else ([outs_a], [outs_b])
        grads = [torch.randn_like(o) for o in outs_a]
        torch.autograd.backward(list(outs_a), grads)
        split = SplitBackward(list(outs_b), grads, [xb], list(two.parameters()))
        got = split.input_pass()
        assert len(seen) == micro * n
        split.weight_pass()
        assert len(seen) == (micro + 1) * n
        assert first or torch.equal(got[0], xa.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(one.parameters(), two.parameters(), strict=True))
