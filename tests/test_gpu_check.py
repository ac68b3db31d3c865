"""benchmarks/gpu_check.py in its CPU --smoke mode: every section reports (ok, or skipped without CUDA),
the JSON and the markdown are written, and a section run in its own process reports back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def test_smoke_writes_json_and_markdown(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_check.py"), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check_smoke.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["stages", "offload_bandwidth", "checkpoint_offload", "step_vs_fsdp2", "zero_inference"]
    for name, sec in sections.items():
        assert sec["status"] in ("ok", "skipped"), (name, sec)
    if not torch.cuda.is_available():
        assert sections["offload_bandwidth"] == {**sections["offload_bandwidth"], "status": "skipped",
                                                 "reason": "no CUDA device"}
    stages = sections["stages"]["rows"]
    assert len(stages) == 4 and all(r["matches"] for r in stages)  # the world-1 probe, then 3 stage cases
    steps = sections["step_vs_fsdp2"]["rows"]
    assert {r["impl"] for r in steps} == {"shardwise", "fsdp2"} and all(r["s_per_step"] > 0 for r in steps)
    assert abs(steps[0]["last_loss"] - steps[1]["last_loss"]) < 1e-2  # same model, batches and optimizer
    assert sections["zero_inference"]["rows"][0]["new_tokens"] == 4
    offload = sections["checkpoint_offload"]["rows"]  # tiny on CPU: bit-exact, the 2 layers' inputs moved
    assert all(r["bit_exact"] for r in offload)
    assert offload[1]["moved_to_host_MiB"] == offload[1]["checkpoint_inputs_MiB"] > 0
    md = (tmp_path / "gpu_check_smoke.md").read_text()
    assert report["environment"]["cpu"] in md and "## zero_inference: ok" in md and "| tokens_per_s |" in md


def test_section_in_its_own_process_reports_back(tmp_path):
    sys.path.insert(0, BENCH)
    import gpu_check

    out = gpu_check.run_section("offload_bandwidth", True, 300, str(tmp_path))
    want = "skipped" if not torch.cuda.is_available() else "ok"
    assert out["status"] == want, out
    assert gpu_check.run_section("stages", True, 1, str(tmp_path))["status"] == "skipped"  # no time left
