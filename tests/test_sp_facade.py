"""The HF Trainer's DeepSpeed sequence-parallel path (``ParallelismConfig(sp_size=2, sp_backend="deepspeed")``)
through ``shardwise launch --as-deepspeed``, no DeepSpeed installed, at ZeRO 2 and 3 (and SP 2 x DP 2 on
4 ranks at ZeRO 2), against the same Trainer script in one process without SP or DeepSpeed; and
Accelerate's documented SP loop at ZeRO 1 and 3 against the same loop in plain PyTorch.

What it proves: Accelerate's and the Trainer's calls (``register_with_transformers`` -> mpu,
``UlyssesSPDataLoaderAdapter``, ``deepspeed.utils.groups._get_sequence_parallel_*``,
``initialize(mpu=...)``, the Trainer's SP loss, served by the facade's ``serve_trainer_sp_loss``) give the
no-SP losses and the no-SP gradient norms: DeepSpeed 0.19.8 reports 2x norms at ZeRO-1/2 here.
Tolerance: tests/tolerance.py's rule from the reference trained again as 2 accumulated micro-batches
of 1 (equal in exact arithmetic).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import facade_launch  # noqa: E402
import sp_facade_job as job  # noqa: E402
from tolerance import equivalence_tol  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _launch(out: Path, nproc: int, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardwise.cli", "launch", "--nproc", str(nproc), "--as-deepspeed",
           str(ROOT / "tests" / "sp_facade_job.py"), str(out), *extra]
    res = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """The 2-rank cases: this job's part of the 2-rank launch this process shares (tests/facade_launch.py)."""
    return json.loads((facade_launch.part(tmp_path_factory, "sp")["root"] / "results.json").read_text())


def _rel(a: dict, b: dict) -> float:
    """Worst relative difference per step (JSON gives string keys, the in-process run ints)."""
    a, b = ({int(k): v for k, v in d.items()} for d in (a, b))
    assert a.keys() == b.keys()
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)


def _trainer_reference(out: Path, steps: int, other: dict, **kw) -> tuple[dict, dict[str, float]]:
    """The Trainer without SP or DeepSpeed in this process, and the bounds from its noise floor: the
    same Trainer again with ``other`` changed (another split, or another experts kernel)."""
    ref = job.run(out / "ref", None, steps=steps, **kw)
    again = job.run(out / "ref_again", None, steps=steps, **{**kw, **other})
    return ref, equivalence_tol({what: _rel(again[what], ref[what]) for what in ("loss", "grad_norm")}, steps)


# Each reference is computed once per file (module scope), by the first test that needs it: the
# tests that compare with it (three stages, two MoE runs) share the one single-process run.
@pytest.fixture(scope="module")
def trainer_ref(tmp_path_factory) -> tuple[dict, dict[str, float]]:
    """Batches of 2; noise floor: 2 accumulated micro-batches of 1."""
    return _trainer_reference(tmp_path_factory.mktemp("sp_ref"), job.STEPS, {"batch": 1, "gas": 2})


@pytest.fixture(scope="module")
def moe_trainer_ref(tmp_path_factory) -> tuple[dict, dict[str, float]]:
    """The MoE model; noise floor: its `eager` experts kernel."""
    return _trainer_reference(tmp_path_factory.mktemp("sp_moe_ref"), job.STEPS, {"moe": "eager"}, moe="default")


@pytest.fixture(scope="module")
def loop_ref() -> tuple[dict, float]:
    """The plain-PyTorch loop (batches of 2 in order); noise floor: each batch in 2 micro-batches."""
    ref = job.reference_loop(1)
    return ref, equivalence_tol({"loss": _rel(job.reference_loop(2), ref)}, job.STEPS)["loss"]


@pytest.mark.parametrize("stage", [2, 3, "3_offload"])
@pytest.mark.subprocess
def test_trainer_sp2_matches_single_process(launched, trainer_ref, stage):
    """3_offload: ZeRO 3 with activation checkpointing and ``shardwise.offload_activation_checkpoints``
    in the DeepSpeed config the Trainer passes: the facade's engine honours the key (bytes moved per step
    on this rank: the 2 layers' inputs, 2 samples x 8 tokens (its shard of 16) x 32 values x 4 bytes)."""
    ref, tol = trainer_ref
    got = launched[f"z{stage}"]
    if stage == "3_offload":
        assert got["offloaded_bytes"] == job.STEPS * 2 * 2 * 8 * 32 * 4, got["offloaded_bytes"]
    for what in ("loss", "grad_norm"):
        assert _rel(got[what], ref[what]) <= tol[what], (what, got[what], ref[what], tol)


@pytest.fixture(scope="module")
def launched_spdp(tmp_path_factory) -> dict:
    return _launch(tmp_path_factory.mktemp("sp_facade_spdp"), 4, "spdp")


@pytest.mark.subprocess
def test_accelerate_sp_loop_sp2_dp2_on_four_gloo_ranks(launched_spdp):
    """Accelerate's documented loop calls torch's differentiable all_gather on the SP group itself; its
    gloo backward fails for the group [2, 3] (no rank 0) unless the facade serves a right one."""
    ref, resplit = job.reference_loop(1, replicas=2), job.reference_loop(2, replicas=2)
    tol = equivalence_tol({"loss": _rel(resplit, ref)}, job.SPDP_STEPS)["loss"]
    assert _rel(launched_spdp["acc_spdp"], ref) <= tol, (launched_spdp["acc_spdp"], ref, tol)


@pytest.mark.subprocess
def test_trainer_sp2_dp2_on_four_gloo_ranks(tmp_path, launched_spdp):
    """SP 2 x DP 2 (SP groups [0, 1] and [2, 3]) at ZeRO 2: transformers' own SP loss fails here on gloo
    (torch's all_gather backward takes the group rank for a global one); the facade's replacement
    gives the no-SP losses and gradient norms of the same samples per step (``job.SPDP_ORDER``)."""
    got = launched_spdp["spdp"]
    ref, tol = _trainer_reference(tmp_path, job.SPDP_STEPS, {"batch": 2, "gas": 2}, batch=4, order=job.SPDP_ORDER)
    for what in ("loss", "grad_norm"):
        assert _rel(got[what], ref[what]) <= tol[what], (what, got[what], ref[what], tol)


@pytest.mark.parametrize("loop", ["acc1", "acc3", "ds2", "ds3"])
@pytest.mark.subprocess
def test_batch_moving_sp_loops_match_plain_torch(launched, loop_ref, loop):
    """The usual batch-moving loop (``batch = {k: v.to(device) for k, v in batch.items()}``, which stops
    at the first non-tensor value) through Accelerate's documented SP loop at ZeRO 1 and 3 (model left
    in eval mode: SP stays on, gradients are enabled) and DeepSpeed 0.19.8's own API (the mpu of
    ``register_with_transformers``, ``UlyssesSPDataLoaderAdapter``, ``engine.backward``) at ZeRO 2 and 3:
    the SP adapter's batches hold tensors only, as DeepSpeed's do, and give the plain-PyTorch losses."""
    ref, tol = loop_ref
    assert _rel(launched[loop], ref) <= tol, (launched[loop], ref, tol)


@pytest.mark.subprocess
def test_accelerate_sp_loop_with_an_moe_model_and_its_aux_loss(launched):
    """Accelerate's documented SP loop at ZeRO 2 with an MoE model (Qwen3-MoE, aux coefficient 0.1, half
    the samples right padded), the loop adding ``router_aux_loss_coef * outputs.aux_loss`` to the SP
    ranks' token-weighted mean: the facade makes ``outputs.aux_loss`` the whole sequence's (router logits
    gathered over the SP group, pads left out by the adapter's token mask), so the losses equal the
    model's own training without SP. Noise floor: the reference with the `eager` experts kernel."""
    ref, other = job.reference_moe_loop(), job.reference_moe_loop("eager")
    tol = equivalence_tol({"loss": _rel(other, ref)}, job.STEPS)["loss"]
    assert _rel(launched["acc_moe"], ref) <= tol, (launched["acc_moe"], ref, tol)


@pytest.mark.parametrize("run", ["moe", "moe_ep"])
@pytest.mark.subprocess
def test_trainer_sp2_moe_aux_loss_matches_single_process(launched, moe_trainer_ref, run):
    """An MoE model (Qwen3-MoE, router aux loss at coefficient 0.1, half the samples right padded) through
    the Trainer's SP path at ZeRO 2: the facade's SP loss takes each shard's aux term out of the model's
    loss and adds the aux loss over the whole sequence once (pads left out by the adapter's token mask),
    so losses and gradient norms equal the same Trainer without SP (the model's own loss and aux loss).
    ``moe_ep``: the same with ``expert_parallel`` (AutoEP's keys, EP 2) in the Trainer's DeepSpeed config,
    SP 2 and EP 2 on the same two ranks. Noise floor: the reference trained again with the `eager`
    experts kernel."""
    ref, tol = moe_trainer_ref
    for what in ("loss", "grad_norm"):
        assert _rel(launched[run][what], ref[what]) <= tol[what], (what, launched[run][what], ref[what], tol)
