"""``zero_to_fp32.py`` in every checkpoint folder, run as users run it (``cd checkpoint-N; python
zero_to_fp32.py . OUT --safe_serialization``), with DeepSpeed's flags and no DeepSpeed installed:
its output equals the live gathered weights, bit for bit (fp32 masters saved and read back)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("z2f") / "checkpoint-2"
    live = pool2.run("zero_to_fp32_cases:train_and_save", str(folder))[0]
    return folder, live


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "zero_to_fp32.py", *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.subprocess
def test_script_sits_next_to_latest(saved):
    folder, _ = saved
    assert {"latest", "zero_to_fp32.py", "global_step2"} <= {p.name for p in folder.iterdir()}
    assert os.stat(folder / "zero_to_fp32.py").st_mode & stat.S_IXUSR


@pytest.mark.subprocess
def test_safetensors_output_equals_live_weights(saved):
    from safetensors.torch import load_file

    folder, live = saved
    res = _run(folder, ".", "OUT", "--safe_serialization")
    assert res.returncode == 0, res.stderr
    got = load_file(folder / "OUT" / "model.safetensors")
    assert got.keys() == live.keys()
    assert all(torch.equal(got[n], live[n]) for n in live)


@pytest.mark.subprocess
def test_deepspeed_flags(saved):
    """The script's other flags, through the function it runs (the same code, no new process)."""
    from shardwise.utils.zero_to_fp32 import main

    folder, live = saved
    out = folder / "BIN"
    assert main([str(folder), str(out), "-t", "global_step2", "--max_shard_size", "100KB",
                 "--exclude_frozen_parameters"]) == 0
    files = sorted(p.name for p in out.glob("pytorch_model-*.bin"))
    assert len(files) > 1 and (out / "pytorch_model.bin.index.json").exists()
    got = {}
    for f in files:
        got.update(torch.load(out / f, weights_only=True))
    assert got.keys() == live.keys() - {"model.embed_tokens.weight"}  # the frozen one left out
    assert all(torch.equal(got[n], live[n]) for n in got)
    from safetensors.torch import load_file

    assert main([str(folder), str(folder / "SAFE"), "--safe_serialization", "--exclude_frozen_parameters"]) == 0
    safe = load_file(folder / "SAFE" / "model.safetensors")
    assert safe.keys() == got.keys() and all(torch.equal(safe[n], got[n]) for n in got)


@pytest.mark.subprocess
def test_user_errors_are_one_line(saved, capsys):
    from shardwise.utils.zero_to_fp32 import main

    folder, _ = saved
    assert main([str(folder), str(folder / "OUT2"), "-t", "global_step9"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "global_step9" in err, err
