"""The DeepSpeed-style scripts in examples/deepspeed_scripts, run on 2 ranks as a launcher runs them
(as ``__main__`` with their argv, in the rank pool: tests/script_cases.py), against plain single-process
PyTorch (issue 10: scripts whose only change is the import line). Launching one for real, its processes
and their exit codes, is tests/test_launch_exit.py's subject."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from script_cases import run_in
from torch import nn

from shardwise.optim.schedules import WarmupLR

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples" / "deepspeed_scripts"
CONFIG = EX / "ds_config.json"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EX / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _launch(pool, script: str, *args: str) -> str:
    """The script on the pool's 2 ranks (``script_cases.run_in``), as the launcher runs it: the
    launcher's own part is tests/test_launch_exit.py's, which launches checkpoint_resume.py for real."""
    return run_in(pool, str(EX / script), list(args))


def _values(out: str, key: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in re.finditer(rf"step (\d+) {key} ([-0-9.e]+)", out)}


def test_argparse_script_matches_plain_pytorch(pool2):
    """add_config_arguments + --deepspeed_config (ZeRO-2, gas 2, clipping, WarmupLR) on 2 ranks."""
    ex = _load("train_argparse")
    got = _values(_launch(pool2, "train_argparse.py", "--deepspeed", "--deepspeed_config", str(CONFIG)), "loss")
    torch.manual_seed(0)
    model = ex.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    sched = WarmupLR(opt, warmup_min_lr=0, warmup_max_lr=0.01, warmup_num_steps=5)
    for step in range(12):
        x, y = ex.global_batch(step, 4 * 2 * 2)
        opt.zero_grad()
        loss = nn.CrossEntropyLoss()(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        assert got[step] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6), step
    assert got[11] < got[0]


def test_client_state_checkpoint_resume_reproduces(pool2, tmp_path):
    """Save with client_state at step 3, load it in a new job, continue: the same losses."""
    common = ["--deepspeed_config", str(CONFIG), "--ckpt_dir", str(tmp_path)]
    first = _launch(pool2, "checkpoint_resume.py", *common, "--save_at", "3")
    resumed = _launch(pool2, "checkpoint_resume.py", *common, "--resume")
    assert "at step 4 (samples seen 64)" in resumed
    a, b = _values(first, "loss"), _values(resumed, "loss")
    assert sorted(b) == [4, 5, 6, 7]
    for s in b:
        assert b[s] == pytest.approx(a[s], rel=1e-6), s
    assert "samples seen 128 global steps 8" in first and "samples seen 128 global steps 8" in resumed


@pytest.mark.parametrize(("tp", "stage"), [(2, 1), (1, 2)], ids=["tp2xdp1-zero1", "tp1xdp2-zero2"])
def test_mpu_tensor_parallel_script_matches_plain_pytorch(pool2, tp, stage):
    """Megatron-style mpu: losses and the clipped global grad norm equal the unsplit model's, with the
    model split over the mpu's model-parallel group, or ZeRO over its data-parallel group."""
    ex = _load("mpu_tensor_parallel")
    out = _launch(pool2, "mpu_tensor_parallel.py", "--tp", str(tp), "--zero_stage", str(stage))
    losses, norms = _values(out, "loss"), {int(m[1]): float(m[2]) for m in
                                           re.finditer(r"step (\d+) loss \S+ grad_norm ([-0-9.e]+)", out)}
    w = {k: nn.Parameter(v.clone()) for k, v in ex.full_weights().items()}
    opt = torch.optim.AdamW(list(w.values()), lr=0.01, weight_decay=0.0)
    for step in range(6):
        x, y = ex.global_batch(step, 8 * (2 // tp))
        h = F.linear(F.gelu(F.linear(x, w["w1"], w["b1"])), w["w2"], w["b2"])
        loss = F.cross_entropy(F.linear(torch.relu(h), w["wh"], w["bh"]), y)
        opt.zero_grad()
        loss.backward()
        norm = nn.utils.clip_grad_norm_(list(w.values()), 0.05)
        opt.step()
        assert losses[step] == pytest.approx(loss.item(), rel=1e-5), step
        assert norms[step] == pytest.approx(norm.item(), rel=1e-5), step
