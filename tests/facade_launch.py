"""One 2-rank ``shardwise launch --as-deepspeed`` shared by the HF-family facade tests of a pytest process.

A launched rank spends ~6 CPU s importing torch, shardwise's facade, transformers and accelerate and
well under 1 s per training case (a tiny model, a few steps), so four 2-rank launches cost about four
times one. The stock scripts of tests/test_hf_facade.py (Trainer, PEFT, Accelerate),
tests/test_hf_seq2seq.py (Seq2SeqTrainer, resize at ZeRO-3), tests/test_moe.py (the Trainer with
``expert_parallel``) and tests/test_sp_facade.py (the Trainer's and Accelerate's SP paths, DeepSpeed's
Ulysses API) therefore run one after another in the same two ranks of one real launch, each into a
folder of its own, and the first of those files to need the results in this pytest process (an xdist
worker) starts the launch; the others read it. Each part starts its trainings afresh as it did in a
launch of its own (``cpu_state`` resets Accelerate's state; each builds its model after its
arguments); the SP part, which registers Ulysses attention with transformers, runs last.

Run as a script (on the ranks): ``facade_launch.py ROOT`` writes ``ROOT/<part>/`` for every part.
The 4-rank SP x DP cases and TRL keep launches of their own (another world size; TRL's imports).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("hf", "seq2seq", "moe", "sp")  # the order the ranks run them in
_launch: dict = {}  # this process's launch: root, stdout, stderr, or the error every reader re-raises


def launched(tmp_path_factory) -> dict:
    """The shared launch's ``{"root", "stdout", "stderr"}`` (``root / part`` holds each part's
    results), launched on the first call in this process; a failed launch fails every reader."""
    if not _launch:
        try:
            _launch.update(_run(tmp_path_factory.mktemp("facade_launch")))
        except AssertionError as e:
            _launch["error"] = str(e)
    assert "error" not in _launch, _launch.get("error")
    return _launch


def _run(root: Path) -> dict:
    import hf_seq2seq_job

    hf_seq2seq_job.tiny_llama().save_pretrained(root / "seq2seq" / "llama")  # the resize case's source
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardwise.cli", "launch", "--nproc", "2", "--as-deepspeed", __file__, str(root)]
    res = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return {"root": root, "stdout": res.stdout, "stderr": res.stderr}


def main() -> None:
    import deepspeed
    import hf_facade_job
    import hf_seq2seq_job
    import moe_trainer_job
    import sp_facade_job

    assert deepspeed.__version__.endswith("+shardwise"), deepspeed  # the facade, even if one is installed
    root = Path(sys.argv[1])
    hf_facade_job.main_at(root / "hf", ["trainer", "accelerate"])
    hf_seq2seq_job.main_at(root / "seq2seq")
    moe_trainer_job.main_at(root / "moe")
    sp_facade_job.main_at(root / "sp")


if __name__ == "__main__":
    main()
