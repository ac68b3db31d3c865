"""Stock TRL scripts at ZeRO-3 on 2 gloo ranks through ``shardwise launch --as-deepspeed``, with
no DeepSpeed installed (issue 33): SFT and DPO (with a reference model, which TRL shards itself
through ``prepare_deepspeed``) against single-process references from the same starting weights;
GRPO (generation inside training, through ``unwrap_model_for_generation``'s hook surface, and a
reference model for its KL term, both loaded from a folder) against
the same script at stage 0 on the same ranks, since sampled completions depend on each rank's
random stream (stage 0 is held to single-process training elsewhere). One launch runs them all
(tests/trl_job.py).

Tolerances: the sharded runs and their references agree in exact arithmetic and differ by fp32
round-off; the bound is K times the reference's own noise floor, measured by training it again
with its batch split into two accumulated micro-batches (tests/tolerance.py).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import facade_launch  # noqa: E402
import trl_job as job  # noqa: E402
from tolerance import equivalence_tol  # noqa: E402

pytest.importorskip("trl")
STEPS = range(1, job.STEPS + 1)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """tests/trl_job.py's part of the 2-rank launch this process shares (tests/facade_launch.py); ``log``:
    what the ranks printed while they ran it."""
    res = facade_launch.part(tmp_path_factory, "trl")
    assert (importlib.util.find_spec("deepspeed") is not None) == ("DeepSpeed is installed" in res["stderr"])
    return {"root": res["root"], "log": res["log"], **json.loads((res["root"] / "results.json").read_text())}


def _max_rel(a: dict, b: dict, keys) -> float:
    return max(abs(a[str(k)] - b[k]) / max(abs(b[k]), 1e-6) for k in keys)


def _weight_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for n in b for x, y in zip(a[n], b[n], strict=True))


def _references(trainer_fn, tmp: Path) -> tuple[dict, dict, float, float]:
    """The script in this process (global batch 4), and its re-split (2 x 2 accumulated)."""
    one = trainer_fn(tmp / "ref", 4, None)
    two = trainer_fn(tmp / "resplit", 2, None, gas=2)
    l1, l2 = job.losses(one), job.losses(two)
    w1, w2 = job.weights(one.model), job.weights(two.model)
    return l1, w1, max(abs(l1[s] - l2[s]) / abs(l1[s]) for s in STEPS), _weight_diff(w2, w1)


@pytest.mark.parametrize("name", ["sft", "dpo"])
@pytest.mark.subprocess
def test_trl_stage3_matches_single_process(launched, tmp_path, name):
    losses, weights, loss_noise, weight_noise = _references(getattr(job, name), tmp_path)
    tol = equivalence_tol({"loss": loss_noise, "w": weight_noise}, job.STEPS)
    run = launched[name]
    assert _max_rel(run["losses"], losses, STEPS) <= tol["loss"]
    assert _weight_diff(run["weights"], weights) <= tol["w"]
    assert run["saved_vs_live"] == 0.0  # save_model writes the trained weights, full shape


@pytest.mark.subprocess
def test_reference_model_config_keys_are_dropped_with_one_warning(launched):
    """TRL's dotted zero_optimization.* keys: one warning per reference model sharded at ZeRO-3
    (DPO's, GRPO's), no unknown-key refusal."""
    assert launched["log"].count("top-level dotted key(s)") == 2


@pytest.mark.subprocess
def test_grpo_stage3_generates_and_trains_as_stage0(launched):
    z0, z3 = launched["grpo0"], launched["grpo3"]
    assert z3["losses"] == z0["losses"]  # the same completions, rewards and advantages
    moved = _weight_diff(z0["weights"], job.weights(job.tiny_llama()))
    assert moved > 1e-5  # the last step trained (the first two sampled equal rewards per group)
    assert _weight_diff(z3["weights"], z0["weights"]) <= 1e-3 * moved
    assert z3["saved_vs_live"] == 0.0


@pytest.mark.subprocess
def test_saved_weights_are_full_shape(launched):
    from safetensors.torch import load_file

    want = {n: tuple(p.shape) for n, p in job.tiny_llama().named_parameters()}
    for folder in ("sft_model", "dpo_model", "grpo_model"):
        saved = load_file(launched["root"] / folder / "model.safetensors")
        assert {n: tuple(t.shape) for n, t in saved.items()} == want, folder
