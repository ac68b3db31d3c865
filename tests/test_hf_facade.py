"""Stock HF Trainer / PEFT / Accelerate scripts on 2 gloo ranks through
``shardwise launch --as-deepspeed`` (issue 18), with no DeepSpeed installed, against plain
single-process references. One launch runs every training (tests/hf_facade_job.py), the launch this
pytest process shares with other facade tests (tests/facade_launch.py).

Tolerances: the stage-2 runs and their references agree in exact arithmetic; they differ by fp32
round-off (two half-batch gradients averaged across ranks instead of one batch). The bound comes
from the measured noise floor (tests/tolerance.py): each reference is trained again with its
batch split into two accumulated micro-batches, and the sharded run may differ by K times that.
Resumes are compared exactly: the resumed run reloads the same bits and replays the same
arithmetic in the same order.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import facade_launch  # noqa: E402
import hf_facade_job as job  # noqa: E402
from tolerance import equivalence_tol  # noqa: E402

LAST = range(job.SAVE_EVERY + 1, job.STEPS + 1)  # the steps a resumed run takes


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """tests/hf_facade_job.py's part of the 2-rank launch this process shares (tests/facade_launch.py)."""
    res = facade_launch.part(tmp_path_factory, "hf")
    # The job checks every rank runs on the facade; an installed DeepSpeed (none here) must be named as unused.
    assert (importlib.util.find_spec("deepspeed") is not None) == ("DeepSpeed is installed" in res["stderr"])
    out = res["root"]
    return {"root": out, **json.loads((out / "results.json").read_text())}


def _rel_diff(a: dict, b: dict, steps) -> float:
    return max(abs(a[str(s)] - b[s]) / abs(b[s]) for s in steps)


def _trainer_reference(tmp: Path, batch: int, gas: int) -> dict[int, float]:
    """The same Trainer script in this one process, no DeepSpeed, the same global batch of 4."""
    from transformers import Trainer

    args = job.training_args(tmp / f"ref{batch}x{gas}", batch=batch, gas=gas)
    trainer = Trainer(model=job.tiny_llama(), args=args, train_dataset=job.dataset())
    trainer.train()
    return job.losses(trainer)


def _torch_reference(split: int) -> dict[int, float]:
    """The Accelerate loop in plain PyTorch: AdamW, clipping at 1.0, batches of 4 in order."""
    model, data = job.tiny_llama(), job.dataset()
    return job.plain_adamw_losses(model, data, job.STEPS, 4, split)


@pytest.mark.subprocess
def test_trainer_stage2_matches_single_process(launched, tmp_path):
    ref = _trainer_reference(tmp_path, batch=4, gas=1)
    resplit = _trainer_reference(tmp_path, batch=2, gas=2)
    steps = range(1, job.STEPS + 1)
    noise = max(abs(resplit[s] - ref[s]) / abs(ref[s]) for s in steps)
    tol = equivalence_tol({"loss": noise}, job.STEPS)["loss"]
    assert _rel_diff(launched["trainer"]["z2"], ref, steps) <= tol


@pytest.mark.subprocess
def test_trainer_resume_continues_exactly(launched):
    t = launched["trainer"]
    assert "global_step4" in t["z2_checkpoint"] and "latest" in t["z2_checkpoint"]  # DeepSpeed's layout
    for s in LAST:
        assert t["z2_resumed"][str(s)] == t["z2"][str(s)], s


@pytest.mark.subprocess
def test_trainer_stage3_saves_full_weights(launched):
    from safetensors.torch import load_file

    saved = load_file(launched["root"] / "z3_model" / "model.safetensors")
    want = {n: p.shape for n, p in job.tiny_llama().named_parameters()}
    assert {n: t.shape for n, t in saved.items()} == want  # every weight, none of size 0
    assert launched["trainer"]["z3_saved_vs_live"] == 0.0  # the trained weights, bit for bit
    assert launched["trainer"]["z3_ds_attrs"]  # ds_id / ds_numel / ds_shape / ds_tensor as DeepSpeed's


@pytest.mark.subprocess
def test_peft_lora_stage3_trains_and_saves_adapters(launched):
    from safetensors.torch import load_file

    lora = launched["trainer"]["lora"]
    saved = load_file(launched["root"] / "lora_model" / "adapter_model.safetensors")
    assert len(saved) == 8 and all(".lora_A." in n or ".lora_B." in n for n in saved)
    for n, t in saved.items():
        out = 16 if "v_proj" in n else 32  # 2 KV heads of 8
        assert t.shape == ((4, 32) if ".lora_A." in n else (out, 4)), n
        if ".lora_B." in n:  # PEFT starts B at zero: non-zero means the adapters trained
            assert t.abs().max() > 0, n
    assert lora["saved_vs_live"] == 0.0
    # B = 0 at step 1: the adapted model computes the base model's loss exactly
    assert abs(lora["losses"]["1"] - launched["trainer"]["z3"]["1"]) <= 1e-6 * abs(lora["losses"]["1"])


@pytest.mark.subprocess
def test_accelerate_stage2_matches_plain_torch(launched):
    ref, resplit = _torch_reference(1), _torch_reference(2)
    steps = range(1, job.STEPS + 1)
    noise = max(abs(resplit[s] - ref[s]) / abs(ref[s]) for s in steps)
    tol = equivalence_tol({"loss": noise}, job.STEPS)["loss"]
    assert _rel_diff(launched["acc2"], ref, steps) <= tol


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.subprocess
def test_accelerate_save_load_state_resumes_exactly(launched, stage):
    run, resumed = launched[f"acc{stage}"], launched[f"acc{stage}_resumed"]
    assert sorted(resumed) == [str(s) for s in LAST]
    for s in LAST:
        assert resumed[str(s)] == run[str(s)], s
