"""Checkpoint I/O: saves through the buffered writer and through the I/O engine; loads verifying
each file when first read, and hashing the files ahead through the I/O engine.

    PYTHONPATH=. python benchmarks/checkpoint/bench_load.py [--size large] [--repeats 3] [--folder DIR]
        [--json out.json]

Two gloo ranks (spawned here) build a Llama at ZeRO-2 with AdamW (fp32 master, exp_avg, exp_avg_sq:
12 bytes a parameter) and take one step. Saves: ``repeats`` synchronous saves with each shard writer,
alternating (``shard_writer.ENGINE`` off: buffered writes; on: ``write_shard_engine``). Loads: one
checkpoint loaded ``repeats`` times each way, alternating: ``streaming`` (``load_plan.AHEAD`` off:
each file's sha256 pass on the loading thread when first used, then a ``pread`` per slice) and
``ahead`` (every file the rank needs hashed on background threads, its chunks read by the engine's
threads, while the loading thread reads its slices; ``checkpoint/hash_ahead.py``). ``cold``: the
files' pages are dropped before each load (``POSIX_FADV_DONTNEED``, as after a restart); ``warm``:
left in the page cache (just written).

Prints rank 0's median wall time of ``save_checkpoint`` and ``load_checkpoint`` per mode, the
checkpoint's size, the 1-minute load average before and after (the machine may be shared), and
``same_bits``: both writers wrote the same files (their sha256) and every load gave the saved bits
(every rank's masters and Adam moments, halved before each load, compared with the state at the
save). Only shardwise, torch, transformers and the standard library are used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_checkpoint import SIZES, build_engine  # the same model and config as the save benchmark


def _engine(size: str):
    engine, _, vocab = build_engine(size)
    ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine


def _drop_cache(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _live(engine) -> list[torch.Tensor]:
    out = []
    for g in engine.groups:
        out.append(g.master)
        out += [v for v in engine.optimizer.state.get(g.master, {}).values() if torch.is_tensor(v) and v.dim()]
    return out


def _snapshot(engine) -> list[torch.Tensor]:
    return [t.detach().clone() for t in _live(engine)]


def _timed_load(engine, folder: Path, mode: str, cold: bool) -> float:
    from shardwise.checkpoint import load_plan

    load_plan.AHEAD = mode == "ahead"
    with torch.no_grad():  # a load that left the state alone would be caught by the comparison
        for t in _live(engine):
            t.mul_(0.5)
    if cold and dist.get_rank() == 0:
        _drop_cache(folder)
    dist.barrier()
    t = time.perf_counter()
    engine.load_checkpoint(str(folder), tag="t")
    return time.perf_counter() - t


def _timed_saves(engine, root: Path, repeats: int) -> tuple[dict[str, float], bool]:
    """Synchronous saves of the same state, the shard writer alternating between its two bodies; the
    median time of each, and whether both wrote the same rank files (their sha256 in metadata.json)."""
    from shardwise.checkpoint import shard_writer

    times: dict[str, list[float]] = {"buffered": [], "engine": []}
    same = True
    for i in range(repeats):
        shas = []
        for mode in times:
            shard_writer.ENGINE = mode == "engine"
            dist.barrier()
            t = time.perf_counter()
            engine.save_checkpoint(str(root), tag=f"w{i}{mode}", asynchronous=False, save_latest=False)
            times[mode].append(time.perf_counter() - t)
            files = json.loads((root / f"w{i}{mode}" / "metadata.json").read_text())["files"]
            shas.append({k: v["sha256"] for k, v in files.items()})
        same = same and shas[0] == shas[1]
        dist.barrier()
        if dist.get_rank() == 0:
            for mode in times:
                shutil.rmtree(root / f"w{i}{mode}")
    shard_writer.ENGINE = False
    return {f"save_{k}_s": round(statistics.median(v), 3) for k, v in times.items()}, same


def _rank(rank: int, port: int, size: str, folder: str, repeats: int, out: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    import shardwise

    shardwise.init_distributed()
    load_before = os.getloadavg()[0]
    engine, root = _engine(size), Path(folder)
    engine.save_checkpoint(str(root), tag="t", asynchronous=False)
    nbytes, saved = sum(p.stat().st_size for p in (root / "t").iterdir()), _snapshot(engine)
    modes = ("streaming", "ahead")
    times: dict[str, list[float]] = {f"{c}_{m}": [] for c in ("cold", "warm") for m in modes}
    saves, same = _timed_saves(engine, root, repeats)
    for _ in range(repeats):
        for cold in (True, False):
            snaps = []
            for mode in modes:
                times[f"{'cold' if cold else 'warm'}_{mode}"].append(_timed_load(engine, root, mode, cold))
                snaps.append(_snapshot(engine))
            same = same and all(all(torch.equal(a, b) for a in snap) for *snap, b in zip(*snaps, saved, strict=True))
    flag = torch.tensor([int(same)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == 0:
        res = {"size": size, "checkpoint_bytes": nbytes, "repeats": repeats,
               **{f"{k}_s": round(statistics.median(v), 3) for k, v in times.items()}, **saves,
               "same_bits": bool(flag.item()), "loadavg_1m_before": load_before,
               "loadavg_1m_after": os.getloadavg()[0], "cpus": os.cpu_count()}
        print(json.dumps(res), flush=True)
        if out:
            Path(out).write_text(json.dumps(res, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="large", choices=sorted(SIZES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--folder", default=None, help="where the checkpoint goes (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    from shardwise.launch.net import free_port

    folder = a.folder or tempfile.mkdtemp(prefix="bench_load_")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.spawn(_rank, args=(free_port(), a.size, folder, a.repeats, a.json), nprocs=2, join=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
