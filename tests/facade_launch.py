"""One 2-rank ``shardwise launch --as-deepspeed`` per pytest process, serving the HF-family facade jobs.

A launched rank spends ~6 CPU s importing torch, shardwise's facade, transformers and accelerate and
well under 1 s per training case (a tiny model, a few steps), so four 2-rank launches cost about four
times one. The stock scripts of tests/test_hf_facade.py (Trainer, PEFT, Accelerate),
tests/test_hf_seq2seq.py (Seq2SeqTrainer, resize at ZeRO-3), tests/test_moe.py (the Trainer with
``expert_parallel``), tests/test_sp_facade.py (the Trainer's and Accelerate's SP paths, DeepSpeed's
Ulysses API), tests/test_trl_facade.py (TRL's SFT, DPO, GRPO; TRL imported only by its part) and
tests/test_monitor.py (every monitoring section, native and facade; W&B offline) are
therefore parts of one real launch: the first file of a pytest process (an xdist
worker) that needs one starts the launch, and each file asks it for its own part, which the two
ranks run one after another, each into a folder of its own. A worker pays for one launch and for
the parts of the files it runs, nothing else. Each part starts its trainings afresh as it did in a
launch of its own (``cpu_state`` resets Accelerate's state; each builds its models after its
arguments). The ranks wait between parts outside any collective (polling the request folder), and
end when asked at the pytest process's exit, or when that process is gone.

A part failing on a rank (or the launch ending, or a part running past its timeout) fails that
part's test and ends the launch (its group may be broken); the next part asked for starts a fresh
launch, so the later files' tests still run (tests/test_facade_launch.py). The 4-rank SP x DP cases
keep a launch of their own.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("hf", "seq2seq", "moe", "sp", "trl", "monitor")  # tests/<job>.py's main_at for each: _JOBS
_POLL_S = 0.1
_launch: dict = {}  # this process's launch: proc, root, done (parts served), error (the first failure)


def part(tmp_path_factory, name: str) -> dict:
    """Part ``name`` run by this process's launch (started on the first call): ``{"root": its results
    folder, "stderr": the launch's stderr so far, "log": what the ranks printed while they ran it}``."""
    assert name in PARTS, name
    if _launch.get("error"):  # an earlier part failed and ended that launch: this part gets a fresh one
        _launch.clear()
    if not _launch:
        _start(tmp_path_factory.mktemp("facade_launch"))
    root = _launch["root"]
    if name not in _launch["done"]:
        try:
            _serve(root, name)
        except AssertionError as e:
            _launch["error"] = f"part {name}: {e}"
            _stop()
            raise
    return {"root": root / name, "stderr": (root / "launch.err").read_text(), "log": _launch["done"][name]}


def _start(root: Path) -> None:
    for folder in ("requests", "replies"):
        (root / folder).mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardwise.cli", "launch", "--nproc", "2", "--as-deepspeed", __file__, str(root),
           str(os.getpid())]
    with open(root / "launch.out", "w") as out, open(root / "launch.err", "w") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=out, stderr=err)
    _launch.update(proc=proc, root=root, done={})
    atexit.register(_stop)


def _serve(root: Path, name: str, timeout_s: float = 1800) -> None:
    """Ask for part ``name`` and wait for rank 0's reply (or any rank's failure, or the launch's end)."""
    if name == "seq2seq":  # the resize case's source, saved here so the plain reference loads the same
        import hf_seq2seq_job

        hf_seq2seq_job.tiny_llama().save_pretrained(root / name / "llama")
    logs = [root / "launch.out", root / "launch.err"]
    start = [len(f.read_text()) for f in logs]
    request = f"{len(_launch['done']):03d}-{name}"
    (root / "requests" / f".{request}").write_text("")
    (root / "requests" / f".{request}").rename(root / "requests" / request)  # whole, or not there
    deadline = time.monotonic() + timeout_s
    while not (root / "replies" / f"{request}.ok").exists():
        failed = sorted((root / "replies").glob(f"{request}.failed*"))
        ended = _launch["proc"].poll()
        assert not failed and ended is None and time.monotonic() < deadline, (
            "\n".join(f.read_text() for f in failed) or f"the launch ended ({ended}) or timed out",
            (root / "launch.out").read_text()[-3000:], (root / "launch.err").read_text()[-5000:])
        time.sleep(_POLL_S)
    _launch["done"][name] = "".join(f.read_text()[n:] for f, n in zip(logs, start, strict=True))


def _stop() -> None:
    """Ask the ranks to end, and end the launch if they do not within a minute."""
    proc = _launch.get("proc")
    if proc is None or proc.poll() is not None:
        return
    (_launch["root"] / "stop").write_text("")
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# each part's job module and the arguments of its ``main_at`` after the folder; imported when the part runs
_JOBS = {"hf": ("hf_facade_job", (["trainer", "accelerate"],)), "seq2seq": ("hf_seq2seq_job", ()),
         "moe": ("moe_trainer_job", ()), "sp": ("sp_facade_job", ()), "trl": ("trl_job", (["sft", "dpo", "grpo"],)),
         "monitor": ("monitor_job", ())}


def _run_part(root: Path, name: str) -> None:
    """Part ``name``, its garbage collector walking only what the part makes: what the ranks hold now
    (torch, transformers, Accelerate, earlier parts' imports) is frozen first, garbage collected before.
    A full collection over that heap cost a rank ~0.2 CPU s, 16 a rank over four files' parts (2026-12-06)."""
    import gc
    import importlib

    gc.collect()
    gc.freeze()
    module, args = _JOBS[name]
    importlib.import_module(module).main_at(root / name, *args)


def _next_request(root: Path, served: int, parent: int) -> str | None:
    """The next part's name, waiting outside any collective; None: stop (asked, or the tests are gone)."""
    while True:
        found = sorted((root / "requests").glob(f"{served:03d}-*"))
        if found:
            return found[0].name.split("-", 1)[1]
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return None
        if (root / "stop").exists():
            return None
        time.sleep(_POLL_S)


def main() -> None:
    import deepspeed
    import torch

    assert deepspeed.__version__.endswith("+shardwise"), deepspeed  # the facade, even if one is installed
    root, parent, rank = Path(sys.argv[1]), int(sys.argv[2]), int(os.environ["RANK"])
    served = 0
    while (name := _next_request(root, served, parent)) is not None:
        request = f"{served:03d}-{name}"
        try:
            _run_part(root, name)
            torch.distributed.barrier()  # every rank done with the part before its results are read
        except BaseException:
            (root / "replies" / f"{request}.failed{rank}").write_text(f"rank {rank}:\n{traceback.format_exc()}")
            raise
        if rank == 0:
            (root / "replies" / f"{request}.ok").write_text("")
        served += 1


if __name__ == "__main__":
    main()
