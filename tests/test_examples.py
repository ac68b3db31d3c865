"""Every example in examples/ runs as examples/README.md says, briefly (a few steps, llama-micro), and its
config holds at any --nproc without a notice; `shardwise train` runs with no --config at all. The
example configs and `make run`'s run config train on the rank pools through the CLI's own entry; the
seed walkthrough is launched as a user launches it.

What the examples show at full length (about a minute each, the held-out loss falling to the end)
is measured in examples/README.md, not here: these runs only prove each command starts, trains and
exits cleanly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rank_pool import RankPool

from shardwise.cli.train_options import parse_args
from shardwise.config import SupportedFeatures, load_config

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples"
CONFIGS = sorted(p.name for p in EX.glob("*.json"))
SHORT = ["--model", "llama-micro", "--seq", "32", "--steps", "3", "--eval-every", "0", "--sample-tokens", "0",
         "--no-export"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _shardwise(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", *args], env=_env(), cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    return log


def test_readme_maps_every_example() -> None:
    readme = (EX / "README.md").read_text()
    for p in sorted(EX.rglob("*")):  # the examples, not the bytecode Python caches beside them
        if p.is_file() and p.name != "README.md" and "__pycache__" not in p.parts:
            assert str(p.relative_to(EX)) in readme, f"examples/README.md does not mention {p.relative_to(EX)}"


@pytest.mark.parametrize("name", CONFIGS)
def test_example_config_holds_at_any_world_size(name: str, tmp_path: Path) -> None:
    raw = json.loads((EX / name).read_text())
    assert "train_batch_size" not in raw and "gradient_accumulation_steps" not in raw  # the batch rule fits any N
    args = parse_args(["--config", str(EX / name), "--steps", "7", "--out", str(tmp_path / "run")])
    tp = (raw.get("tensor_parallel") or {}).get("autotp_size", 1)
    for world in range(tp, 4 * tp + 1, tp):
        cfg = load_config(args.ds_config, world_size=world, supported=SupportedFeatures.everything())
        assert cfg._ignored == [], (name, cfg._ignored)  # no "accepted and ignored" notice
        assert cfg.train_batch_size == raw["train_micro_batch_size_per_gpu"] * world // tp
    params = (args.ds_config.get("scheduler") or {}).get("params") or {}
    assert params.get("total_num_steps", 7) == 7  # follows --steps


def test_make_run_config_holds_at_any_world_size(tmp_path: Path) -> None:
    """`make run` starts one rank per GPU: its batch fits 1-8 of them (16 sequences at 2, as documented)."""
    args = parse_args(["--run-config", str(EX / "sonnets.toml"), "--out", str(tmp_path / "run")])
    for world in range(1, 9):
        cfg = load_config(args.ds_config, world_size=world, supported=SupportedFeatures.everything())
        assert cfg._ignored == [] and cfg.train_batch_size == 8 * world and cfg.gradient_accumulation_steps == 2


def test_the_defaults_hold_at_any_world_size(tmp_path: Path) -> None:
    args = parse_args(["--steps", "50", "--out", str(tmp_path / "run")])
    assert args.config is None and args.ds_config["scheduler"]["params"]["warmup_num_steps"] == 5
    for world in range(1, 6):
        cfg = load_config(args.ds_config, world_size=world, supported=SupportedFeatures.everything())
        assert cfg._ignored == [] and cfg.train_batch_size == 4 * world and cfg.gradient_accumulation_steps == 1


def _train_in(pool: RankPool, *args: str) -> str:
    """`shardwise train ARGS` on the pool's ranks through the CLI's entry (tests/train_cases.py): every
    rank's output, as a launch prints it."""
    answers = pool.run("train_cases:train", list(args), timeout=600)
    log = "".join(stdout + stderr for _, stdout, stderr in answers)
    assert all(code == 0 for code, _, _ in answers), log[-3000:]
    return log


@pytest.mark.parametrize("name", CONFIGS)
def test_example_config_trains(name: str, tmp_path: Path, pool2: RankPool) -> None:
    log = _train_in(pool2, "--config", str(EX / name), *SHORT, "--out", str(tmp_path / "run"))
    assert "final eval loss" in log
    assert not re.search(r"warning|accepted and ignored|note:", log, re.IGNORECASE), log[-3000:]


def test_make_run_config(tmp_path: Path, pool2: RankPool) -> None:
    """`make run`'s run config (its steps cut short here), from the checkout as `make run` runs it, on
    the pool's 2 ranks: the config is the subject; a launched 2-rank `shardwise train` is
    test_train_job's and test_exports' (the launch adds nothing to a rank's output)."""
    answers = pool2.run("train_cases:train_from", str(ROOT), ["--run-config", "examples/sonnets.toml", *SHORT,
                                                               "--out", str(tmp_path / "run")], timeout=600)
    log = "".join(stdout + stderr for _, stdout, stderr in answers)
    assert all(code == 0 for code, _, _ in answers), log[-3000:]
    assert "final eval loss" in log and "warning" not in log.lower()


@pytest.mark.subprocess
def test_seed_walkthrough(tmp_path: Path) -> None:
    log = _shardwise("launch", "--nproc", "2", "examples/seed_walkthrough.py")
    assert "bit-identical to W: True" in log


def test_train_without_a_config(tmp_path: Path, pool1: RankPool) -> None:
    """The documented defaults: printed at the start, saved in run_config.json, the run ends cleanly."""
    out = tmp_path / "run"
    log = _train_in(pool1, "--model", "llama-micro", "--data", str(ROOT / "data" / "sonnets.txt"), "--seq", "32",
                    "--steps", "3", "--sample-tokens", "0", "--no-export", "--out", str(out))
    assert "no --config: the defaults (ZeRO stage 2, AdamW" in log
    saved = json.loads((out / "run_config.json").read_text())["config"]
    assert saved["zero_optimization"]["stage"] == 2 and saved["optimizer"]["type"] == "AdamW"
    assert saved["scheduler"]["params"]["total_num_steps"] == 3


def test_notes_on_memorising() -> None:
    """The issue's run (400 steps of 16 sequences over 43) is warned about, the examples' (60 x 8) not."""
    from shardwise.train.advice import eval_rise_note, passes_note

    note = passes_note(400, 16, 43)
    assert note is not None and "149 passes over the 43 training sequences" in note and "--steps 80 or fewer" in note
    assert passes_note(60, 8, 43) is None
    rows = [{"step": s, "eval_loss": v} for s, v in ((10, 3.1), (20, 2.4), (30, 2.5))]
    assert eval_rise_note(rows) is None  # within 10% of the best: noise
    rows.append({"step": 40, "eval_loss": 5.2})
    assert "rose from 2.400 at step 20 to 5.200" in eval_rise_note(rows)
