"""A stock HF Trainer script (examples/hf_trainer/train_trainer.py) runs unchanged on CPU under
`shardwise launch --as-deepspeed`: Accelerate counts both gloo ranks (no PartialState workaround in
the script), and a batch size filled for the wrong process count is refused naming the real fix."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from shardwise.config.schema import ConfigError
from shardwise.deepspeed import accelerate_state, stage3

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples" / "hf_trainer"


@pytest.mark.subprocess
def test_stock_trainer_script_runs_on_two_cpu_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardwise.cli", "launch", "--nproc", "2", "--as-deepspeed",
           str(EX / "train_trainer.py"), "--deepspeed", str(EX / "ds_zero2.json"), "--max_steps", "3",
           "--per_device_train_batch_size", "2",
           "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--save_strategy", "no",
           "--disable_tqdm", "true"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "processes 2, global batch 4" in r.stdout, r.stdout[-2000:]


def _fake_accelerate(monkeypatch: pytest.MonkeyPatch, shared: dict, world: int) -> None:
    mod = types.ModuleType("accelerate.state")
    mod.PartialState = type("PartialState", (), {"_shared_state": shared})
    monkeypatch.setitem(sys.modules, "accelerate.state", mod)
    monkeypatch.setattr(accelerate_state.tdist, "is_initialized", lambda: True)
    monkeypatch.setattr(accelerate_state.tdist, "get_world_size", lambda: world)


def test_the_backend_is_recorded_only_in_a_half_built_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accelerate_state.comm_api, "init_distributed", lambda *a, **k: None)
    monkeypatch.setattr(accelerate_state.tdist, "get_backend", lambda: "gloo")
    for shared, want in (({"backend": None, "_cpu": False}, "gloo"),  # mid-__init__, no backend: fixed
                         ({"backend": None, "num_processes": 1}, None),  # a finished state: left alone
                         ({"backend": "nccl"}, "nccl")):  # a backend chosen: left alone
        _fake_accelerate(monkeypatch, shared, 2)
        accelerate_state.init_distributed(dist_backend=None)
        assert shared["backend"] == want


def test_batch_size_refusal_names_the_process_count(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_accelerate(monkeypatch, {"backend": None, "num_processes": 1}, 2)

    def refuse(*args: object, **kwargs: object) -> None:
        raise ConfigError("train_batch_size: 2 != train_micro_batch_size_per_gpu (2) x ... dp_world (2) = 4")

    monkeypatch.setattr(stage3, "shardwise_initialize", refuse)
    with pytest.raises(ConfigError, match=r"Accelerate counted 1 process\(es\) but 2 ranks"):
        stage3.initialize(model=None, config={})
    _fake_accelerate(monkeypatch, {"backend": "gloo", "num_processes": 2}, 2)  # counts agree: unchanged
    with pytest.raises(ConfigError) as info:
        stage3.initialize(model=None, config={})
    assert "Accelerate" not in str(info.value)
