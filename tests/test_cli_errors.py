"""Every user error of the `shardwise` CLI: one line on stderr, exit code 2, no traceback.

Each case runs the real command line (``shardwise.cli.main``, what ``python -m shardwise.cli``
calls) with its stderr captured at the file descriptor. All of them fail before any process group
starts (argument, file and config checks come first), so they run one after another in a single
subprocess (``cli_error_runner.py``): the 25 cases pay Python's and torch's start-up once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNER = str(Path(__file__).resolve().parent / "cli_error_runner.py")
EXAMPLE = str(ROOT / "examples" / "zero2_llama.json")


def _model_config(tmp_path: Path, name: str, **changes) -> str:
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 100} | changes
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, a word the one-line message must contain)."""
    bad_cfg = tmp / "bad_ds.json"
    bad_cfg.write_text('{"train_batch_size": 16, "zero_optimization": {"stag": 2}}')
    float_steps = tmp / "float_steps.toml"
    float_steps.write_text("steps = 2.5\n")
    batch16 = tmp / "batch16.json"  # 16 = 4 x 2 x dp_world: no whole dp_world of 3 (the examples fit any N)
    batch16.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                   "gradient_accumulation_steps": 2}))
    (tmp / "trained" / "hf").mkdir(parents=True, exist_ok=True)  # a `shardwise train` run folder's export
    (tmp / "trained" / "hf" / "config.json").write_text("{}")
    return {
        "generate missing model": (["generate", "--model", "/missing", "--prompt", "hi"], "/missing"),
        "generate run folder": (["generate", "--model", str(tmp / "trained"), "--prompt", "hi"],
                                "is a run folder; its exported model is --model "),
        "estimate 1e400 params": (["estimate", "--params", "1e400", "--devices", "2"], "--params"),
        "estimate negative params": (["estimate", "--params", "-5", "--devices", "2"], "--params"),
        "estimate string params": (["estimate", "--params", "abc", "--devices", "2"], "--params"),
        "estimate zero heads": (["estimate", "--model", _model_config(tmp, "h0", num_attention_heads=0),
                                 "--devices", "2"], "num_attention_heads"),
        "estimate negative hidden": (["estimate", "--model", _model_config(tmp, "neg", hidden_size=-64),
                                      "--devices", "2"], "hidden_size"),
        "estimate string hidden": (["estimate", "--model", _model_config(tmp, "str", hidden_size="abc"),
                                    "--devices", "2"], "hidden_size"),
        "estimate 100k layers": (["estimate", "--model", _model_config(tmp, "deep", num_hidden_layers=100_000),
                                  "--devices", "2"], "num_hidden_layers"),
        "estimate missing model": (["estimate", "--model", str(tmp / "nope"), "--devices", "2"], "--model"),
        "estimate a train preset": (["estimate", "--model", "llama-tiny", "--devices", "2"],
                                    "a `shardwise train` preset, not a file: pass a run's export, RUN/hf"),
        "train hub name": (["train", "--model", "gpt2", "--steps", "1", "--out", str(tmp / "hub_run")],
                           "Hub names are not downloaded"),
        "train steps 0": (["train", "--config", EXAMPLE, "--steps", "0"], "--steps"),
        "train seq 0": (["train", "--config", EXAMPLE, "--seq", "0"], "--seq"),
        "train steps string": (["train", "--config", EXAMPLE, "--steps", "ten"], "--steps"),
        "train timeout 0": (["train", "--config", EXAMPLE, "--timeout", "0"], "--timeout"),
        "train missing config": (["train", "--config", str(tmp / "none.json")], "--config"),
        "train bad config key": (["train", "--config", str(bad_cfg), "--steps", "1", "--out", str(tmp / "typo_run")],
                                 "stag"),
        "train missing data": (["train", "--config", EXAMPLE, "--data", str(tmp / "nodata.txt"), "--out",
                                str(tmp / "nodata_run")], "nodata.txt"),
        "train float steps in run config": (["train", "--config", EXAMPLE, "--run-config", str(float_steps)],
                                            "'steps' must be a whole number, got 2.5"),
        "consolidate missing folder": (["consolidate", str(tmp / "nockpt"), str(tmp / "out")], "nockpt"),
        "quantize group size 3": (["quantize", str(tmp / "src"), str(tmp / "q"), "--bits", "4", "--group-size", "3"],
                                  "group_size"),
        "quantize kernel order 48": (["quantize", str(tmp / "src"), str(tmp / "q"), "--bits", "4",
                                      "--kernel-order", "48"], "--kernel-order"),
        "launch nproc 0": (["launch", "--nproc", "0", "--", "train", "--config", EXAMPLE], "--nproc"),
        "launch nproc string": (["launch", "--nproc", "two", "--", "train", "--config", EXAMPLE], "--nproc"),
        "launch no target": (["launch", "--nproc", "2"], "subcommand"),
        "launch missing script": (["launch", "--nproc", "2", "--", str(tmp / "x.py")], "x.py"),
        "launch train bad steps": (["launch", "--nproc", "2", "--max-restarts", "2", "--", "train", "--config",
                                    EXAMPLE, "--steps", "0"], "--steps"),
        "launch train batch rule": (["launch", "--nproc", "3", "--", "train", "--config", str(batch16)],
                                    "train_batch_size"),
        "unknown command": (["trian"], "trian"),
    }


CASE_NAMES = list(_cases(Path(tempfile.mkdtemp(prefix="cli_cases_"))))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SimpleNamespace]:
    """Run every case once, in one subprocess (each case alone is mostly Python start-up and imports)."""
    tmp = tmp_path_factory.mktemp("cli")
    cases, out = tmp / "cases.json", tmp / "results.json"
    cases.write_text(json.dumps({name: argv for name, (argv, _) in _cases(tmp).items()}))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, RUNNER, str(cases), str(out)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=tmp)  # train without --out writes runs/default here
    assert done.returncode == 0, done.stderr[-3000:]
    found = {name: SimpleNamespace(**r) for name, r in json.loads(out.read_text()).items()}
    found["run folders left"] = SimpleNamespace(paths=sorted(p.name for p in tmp.iterdir() if p.name.endswith("_run")
                                                              or p.name == "runs"))
    return found


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.subprocess
def test_user_error_is_one_line_exit_2(name: str, results: dict, tmp_path: Path) -> None:
    word = _cases(tmp_path)[name][1]
    r = results[name]
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-2000:]
    assert word in lines[0] and "error" in lines[0], lines[0]


@pytest.mark.subprocess
def test_refused_train_leaves_no_run_folder(results: dict) -> None:
    """A config typo or a missing --data is refused before --out is created (it used to leave a lock,
    run_config.json and the tokenized data there, after half a minute of work)."""
    assert results["run folders left"].paths == []


@pytest.mark.subprocess
def test_launch_space_form_reaches_the_subcommand() -> None:
    """`--max-restarts 2 -- train` and `--rdzv-backend c10d train`: the target is `train`, not a file."""
    from shardwise.cli.command import _split_target

    for argv in (["--nproc", "2", "--max-restarts", "2", "--", "train", "--steps", "3"],
                 ["--nproc", "2", "--rdzv-backend", "c10d", "--", "train", "--steps", "3"],
                 ["--nproc", "2", "--max-restarts", "2", "train", "--steps", "3"]):
        flags, target = _split_target(argv)
        assert target == ["train", "--steps", "3"] and flags[:2] == ["--nproc", "2"], (flags, target)
