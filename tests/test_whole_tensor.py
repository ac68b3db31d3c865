"""Non-elementwise optimizers step whole parameters (shardwise/zero/whole_tensor.py), against one process.

Tolerance: none. The reference (whole_tensor_cases.reference) averages the two ranks' gradients as
the ranks do, ``(g_0 + g_1) * 0.5``; a sum of two fp32 values does not depend on its order, so the
ranks' reduced gradient is bit-identical, and the whole-tensor step then runs the same optimizer code
on the same fp32 tensors. Only at more than 2 ranks would the ring's summation order enter (the
noise floor of tests/tolerance.py), which is why these tests run on 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from whole_tensor_cases import RESUME_STEPS, SAVE_AT, reference

from shardwise.optim.ds_optimizers import Lamb, gram_newton_schulz, newton_schulz
from shardwise.zero.elementwise import is_elementwise, register_elementwise
from shardwise.zero.whole_tensor import deal_whole_tensors

ALL_SHAPES = {(509, 64), (64, 509), (64,), (64, 64), (32, 64), (96, 64), (64, 96)}  # tests/tiny_models llama


def _assert_exact(res: list[dict], ref: dict) -> None:
    for key, run in res[0].items():
        assert run["weights"].keys() == ref["weights"].keys(), key
        for n, want in ref["weights"].items():
            got = run["weights"][n]
            assert torch.equal(got, want), (key, n, (got - want).abs().max().item())
        for r in range(len(res)):
            assert res[r][key]["losses"] == ref["losses"][r], (key, r)


def _assert_whole(res: list[dict]) -> None:
    """Each rank stepped whole tensors, about half of them by size, and the two halves cover the model."""
    for key in res[0]:
        owned = [res[r][key]["owned_numel"] for r in range(2)]
        assert all(shape in ALL_SHAPES for shape in res[0][key]["shapes"]), key
        assert abs(owned[0] - owned[1]) <= 509 * 64, (key, owned)  # balanced to within the largest tensor


@pytest.mark.parametrize("case", ["adafactor", "muon_torch", "lamb_like", "lamb_config", "muon_config"])
def test_whole_tensor_optimizer_matches_single_process(pool2, case):
    """Stages 1-3 through ShardedOptimizer and initialize() (a client instance, or the config's
    "Lamb"/"Muon" section for the config cases): bit-identical to the single-process loop."""
    stages = (0, 1, 2, 3) if case == "adafactor" else (1, 2, 3)
    res = pool2.run("whole_tensor_cases:train_case", case, stages)
    _assert_exact(res, reference(case))
    _assert_whole(res)
    if case == "adafactor":  # memory_report(): the owned fp32 copies, and what step() adds
        stage0, stage2 = res[0]["engine:0"]["memory"], res[0]["engine:2"]["memory"]
        assert stage0["whole_tensor_params"] == 0  # stage 0: the optimizer steps views of the whole masters
        assert stage2["whole_tensor_params"] == 4 * res[0]["engine:2"]["owned_numel"]
        assert stage2["whole_tensor_step_buffers"] > stage2["whole_tensor_params"]


def test_hybrid_shard2_replicate2(pool4):
    """4 ranks as 2 replicas of shard groups of 2: tensors are dealt within a shard group; still exact."""
    res = pool4.run("whole_tensor_cases:train_case", "lamb_like", (2, 3), ("functional",), shard_size=2)
    _assert_exact(res, reference("lamb_like", world=4))


def test_client_factories_pick_by_the_class_they_build(pool2):
    """initialize(optimizer=lambda groups: ...): an Adafactor factory steps whole tensors (exactly), an
    AdamW factory flat shards."""
    whole = pool2.run("whole_tensor_cases:train_case", "adafactor_factory", (2,), ("engine",))
    _assert_exact(whole, reference("adafactor"))
    _assert_whole(whole)
    flat = pool2.run("whole_tensor_cases:train_case", "adamw_factory", (2,), ("engine",))
    assert all(len(s) == 1 for s in flat[0]["engine:2"]["shapes"])
    assert flat[0]["engine:2"]["memory"]["whole_tensor_params"] == 0


def _assert_same(got: dict, want: dict, what: str) -> None:
    """Weights and losses bit for bit equal."""
    assert got["weights"].keys() == want["weights"].keys(), what
    for n, w in want["weights"].items():
        g = got["weights"][n]
        assert torch.equal(g, w), (what, n, (g - w).abs().max().item())
    assert got["losses"] == want["losses"], what


@pytest.mark.parametrize(("case", "api"), [("adafactor", "engine"), ("muon_torch", "functional")])
def test_whole_tensor_checkpoint_resumes_at_any_layout(pool2, tmp_path, case, api):
    """Save at 2 ranks stage 2 after 3 steps, then 2 more steps. Resumed from other initial weights:
    at stage 2 bit-identical to the uninterrupted run; at stage 3 bit-identical to the single-process
    reference continuing (the argument above: 2 ranks, one fp32 addition); at world 1 (this process)
    bit-identical too: it accumulates the two micro batches' half losses, ``g0 * 0.5 + g1 * 0.5``, and
    halving is exact in fp32, so that is the reference's ``(g0 + g1) * 0.5``. Tolerance: none."""
    ckpt = str(tmp_path / "ckpt")
    res = pool2.run("whole_tensor_cases:save_and_resume", case, api, ckpt)
    ref = reference(case, steps=SAVE_AT + RESUME_STEPS)
    ref_after = {"weights": ref["weights"], "losses": ref["losses"][0][SAVE_AT:]}
    for r in (0, 1):
        _assert_same(res[r]["stage2"], res[r]["uninterrupted"], f"rank {r} stage 2")
        _assert_same(res[r]["stage3"], {**ref_after, "losses": ref["losses"][r][SAVE_AT:]}, f"rank {r} stage 3")
    one = _in_one_process("resume_world1", case, "functional", ckpt)
    both = [(a + b) / 2 for a, b in zip(ref["losses"][0][SAVE_AT:], ref["losses"][1][SAVE_AT:], strict=True)]
    _assert_same(one, {"weights": ref["weights"], "losses": both}, "world 1")
    if case == "adafactor":
        _refusals(ckpt, tmp_path)
        _exports_read_the_weights(ckpt, tmp_path)


def _exports_read_the_weights(ckpt: str, tmp_path) -> None:
    """consolidate and zero_to_fp32 read the masters and skip the whole-tensor section: the weights
    after 3 steps, bit for bit those of the single-process reference."""
    from safetensors.torch import load_file

    from shardwise.checkpoint import consolidate
    from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    want = reference("adafactor", steps=SAVE_AT)["weights"]
    consolidate(ckpt, tmp_path / "hf", weights_only=True)
    for got in (load_file(str(tmp_path / "hf" / "model.safetensors")), get_fp32_state_dict_from_zero_checkpoint(ckpt)):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], w) for n, w in want.items())


def _in_one_process(fn: str, *args):
    import whole_tensor_cases
    from ckpt_cases import world1_group

    world1_group()
    return getattr(whole_tensor_cases, fn)(*args)


def _refusals(ckpt: str, tmp_path) -> None:
    """Damaged whole-tensor state, and state of the other layout, are refused by name (one process)."""
    import json
    import shutil

    folder = Path(ckpt) / "global_step3"
    meta = json.loads((folder / "metadata.json").read_text())
    section = meta["whole_tensor_state"]
    assert section["optimizer"] == "Adafactor"
    name, entry = next((n, e) for n, e in section["tensors"].items() if "row_var" in e["states"])
    assert section["tensors"][name]["states"]["row_var"]["shape"][-1] == 1  # Adafactor's row factor, as torch made it
    flat = _in_one_process("load_error", "adamw_factory", ckpt)  # AdamW: flat shards
    assert "holds the whole-tensor state of a Adafactor" in flat and "load_optimizer_states=False" in flat
    missing = tmp_path / "missing"
    shutil.copytree(ckpt, missing)
    del meta["whole_tensor_state"]["tensors"][name]
    (missing / "global_step3" / "metadata.json").write_text(json.dumps(meta))
    msg = _in_one_process("load_error", "adafactor", str(missing))
    assert f"has no state for {name!r}" in msg and "metadata.json" in msg
    cut = tmp_path / "cut"
    shutil.copytree(ckpt, cut)
    shard = cut / "global_step3" / entry["file"]
    shard.write_bytes(shard.read_bytes()[:-64])
    msg = _in_one_process("load_error", "adafactor", str(cut))
    assert entry["file"] in msg and "truncated" in msg


def test_declared_elementwise_optimizer_stays_flat(pool2):
    """A user's optimizer with ``shardwise_elementwise = True`` steps the flat 1-D shards, still exactly."""
    res = pool2.run("whole_tensor_cases:train_case", "sign_momentum", (1, 2, 3))
    _assert_exact(res, reference("sign_momentum"))
    for run in res[0].values():
        assert all(len(s) == 1 for s in run["shapes"]) and all(len(s) == 1 for s in run["seen"])


@pytest.mark.parametrize("stage", [1, 3])
def test_unknown_optimizer_never_sees_a_flat_slice(pool2, stage):
    """The old silent-wrong case: an undeclared class was handed 1-D slices spanning several tensors."""
    res = pool2.run("whole_tensor_cases:train_probe", stage)
    seen = set(res[0]["seen"]) | set(res[1]["seen"])
    assert seen == set(map(tuple, res[0]["model_shapes"]))


def test_tensor_parallel_slice_is_refused_by_name(pool2):
    msg = pool2.run("whole_tensor_cases:tp_refusal")[0]
    assert "Adafactor is not an elementwise optimizer" in msg and "tensor-parallel slice" in msg


def test_which_optimizers_are_elementwise():
    assert all(is_elementwise(getattr(torch.optim, n)) for n in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop",
                                                                 "Adamax", "NAdam", "RAdam", "Adadelta", "Rprop",
                                                                 "ASGD"))
    assert not any(is_elementwise(c) for c in (torch.optim.Adafactor, torch.optim.Muon, torch.optim.LBFGS, Lamb))

    class KeepsStep(torch.optim.AdamW):
        pass

    class NewStep(torch.optim.AdamW):
        def step(self, closure=None):
            return None

    class Declared(torch.optim.Optimizer):
        shardwise_elementwise = True

    class Mine(torch.optim.Optimizer):
        pass

    FusedAdam = type("FusedAdam", (torch.optim.Optimizer,), {"__module__": "deepspeed.ops.adam.fused_adam"})
    assert is_elementwise(FusedAdam)  # DeepSpeed's, known by name
    KeepsStep([torch.zeros(2)])  # torch wraps step() on first construction: still AdamW's
    assert is_elementwise(KeepsStep) and not is_elementwise(NewStep) and is_elementwise(Declared)
    assert not is_elementwise(Mine) and register_elementwise(Mine) is Mine and is_elementwise(Mine)
    with pytest.raises(TypeError, match="register_elementwise"):
        register_elementwise(int)


def test_deal_is_balanced_and_deterministic():
    assert deal_whole_tensors([10, 1, 1, 8, 2], 2) == [0, 0, 1, 1, 1]  # largest first: 10 + 1 | 8 + 2 + 1
    assert deal_whole_tensors([5, 5, 5], 3) == [0, 1, 2]


def test_lamb_is_fused_lamb_formula():
    """One FusedLamb step from empty state, written out: u = m/(sqrt(v)+eps) + wd*w, trust ratio clamped."""
    torch.manual_seed(0)
    w, g = torch.randn(4, 5), torch.randn(4, 5)
    p = w.clone().requires_grad_()
    p.grad = g.clone()
    lr, b1, b2, eps, wd, max_coeff = 1e-2, 0.9, 0.999, 1e-8, 0.1, 0.5
    Lamb([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, max_coeff=max_coeff).step()
    m, v = (1 - b1) * g, (1 - b2) * g * g
    u = m / (v.sqrt() + eps) + wd * w
    coeff = min(max((w.norm() / u.norm()).item(), 0.01), max_coeff)
    want = w - lr * (1 - b2) ** 0.5 / (1 - b1) * coeff * u
    torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)


def test_gram_newton_schulz_is_the_standard_iteration():
    """In fp64 the Gram form (DeepSpeed's default "gram") equals the quintic iteration to round-off."""
    torch.manual_seed(0)
    for shape in [(64, 96), (96, 64), (64, 64), (32, 200)]:
        g = torch.randn(*shape, dtype=torch.float64)
        a, b = newton_schulz(g, dtype=torch.float64), gram_newton_schulz(g, dtype=torch.float64)
        assert ((a - b).norm() / a.norm()).item() < 1e-12
