"""Synchronous against asynchronous checkpoints: how long a save stops training, what it costs.

    PYTHONPATH=. python benchmarks/checkpoint/bench_checkpoint.py [--sizes small,large] [--saves 3]
        [--folder /tmp/bench_ckpt] [--json out.json]

Two gloo ranks (spawned here) train a Llama at ZeRO-2 with AdamW (fp32: master, exp_avg, exp_avg_sq
saved, 12 bytes a parameter) and save after a step, several times each way. Per size it prints:

- ``blocking_s``: wall time of the ``save_checkpoint`` call on rank 0 (median over the saves); async:
  until the state is staged, sync: until the checkpoint is published;
- ``write_s`` (async): from the call until the save was published (by a later step's poll);
- ``extra_host_mb``: rank 0's peak RSS during an async save above its RSS before the call (the
  staged copy), and ``rss_after_mb``: RSS after the publication above RSS before the first save,
  per save (flat: the copy is freed after each write);
- ``step_s`` / ``overlapped_step_s``: median step time with no save pending, and of the steps the
  writer overlapped (the writer thread shares the cores with training);
- ``kept_buffer_*``: the same async saves with ``shardwise.keep_checkpoint_buffer`` on (the staging
  buffer kept for the next save; the first save allocates it and is left out of the median);
- ``load_s``: a synchronous ``load_checkpoint`` of the last checkpoint.

Only shardwise, torch, transformers and the standard library are used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = {  # name: (hidden, layers, intermediate, vocab)
    "small": (512, 4, 1376, 8000),
    "large": (768, 8, 2048, 32000),
}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class PeakRSS:
    """This process's peak RSS, sampled every 5 ms from a thread while a ``with`` block runs."""

    def __enter__(self) -> PeakRSS:
        self.peak, self.stop = _rss_mb(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def build_engine(size: str):
    """A Llama of ``SIZES[size]`` at ZeRO-2 with AdamW, seeded; also its parameter count and vocabulary
    (bench_load.py builds the same one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardwise

    hidden, layers, inter, vocab = SIZES[size]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                                         vocab_size=vocab, num_attention_heads=8, num_key_value_heads=8,
                                         max_position_embeddings=64))
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    return engine, sum(p.numel() for p in model.parameters()), vocab


def _step(engine, vocab: int, i: int) -> float:
    ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(i * 10 + dist.get_rank()))
    t = time.perf_counter()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return time.perf_counter() - t


def _sync_saves(engine, vocab: int, folder: Path, saves: int) -> list[float]:
    out = []
    for i in range(saves):
        _step(engine, vocab, 100 + i)
        dist.barrier()
        t = time.perf_counter()
        engine.save_checkpoint(folder / "sync", tag=f"s{i}", asynchronous=False)
        out.append(time.perf_counter() - t)
    return out


def _async_saves(engine, vocab: int, folder: Path, saves: int, keep: bool) -> dict:
    from shardwise.checkpoint import async_save

    engine.config.shardwise.keep_checkpoint_buffer = keep  # shardwise.keep_checkpoint_buffer

    block, write, extra, after, overlapped = [], [], [], [], []
    base_rss = _rss_mb()
    for i in range(saves):
        _step(engine, vocab, 200 + i)
        dist.barrier()
        before = _rss_mb()
        with PeakRSS() as peak:
            t = time.perf_counter()
            engine.save_checkpoint(folder / "async", tag=f"a{int(keep)}{i}", asynchronous=True)
            block.append(time.perf_counter() - t)
            n = 0
            while async_save.pending_tag() is not None:  # training goes on; a step's poll publishes
                overlapped.append(_step(engine, vocab, 300 + 10 * i + n))
                n += 1
            write.append(time.perf_counter() - t)
        extra.append(peak.peak - before)
        after.append(_rss_mb() - base_rss)
    return {"blocking": block, "write": write, "extra": extra, "after": after, "overlapped": overlapped}


def _size_run(size: str, folder: Path, saves: int) -> dict:
    engine, n_params, vocab = build_engine(size)
    for i in range(2):  # warm up (Adam state allocated)
        _step(engine, vocab, i)
    plain = [_step(engine, vocab, 50 + i) for i in range(4)]
    sync = _sync_saves(engine, vocab, folder, saves)
    asy = _async_saves(engine, vocab, folder, saves, keep=False)
    kept = _async_saves(engine, vocab, folder, saves + 1, keep=True)  # the first one allocates the buffer
    dist.barrier()
    t = time.perf_counter()
    engine.load_checkpoint(folder / "async")
    load_s = time.perf_counter() - t
    state_bytes = sum(f.stat().st_size for f in (folder / "sync" / "s0").glob("*.safetensors"))
    med = statistics.median
    return {"size": size, "params": n_params, "state_gb": round(state_bytes / 1e9, 3),
            "sync_blocking_s": round(med(sync), 3), "sync_all_s": [round(x, 3) for x in sync],
            "async_blocking_s": round(med(asy["blocking"]), 3),
            "async_all_s": [round(x, 3) for x in asy["blocking"]],
            "blocking_ratio": round(med(asy["blocking"]) / med(sync), 3),
            "async_write_s": round(med(asy["write"]), 3),
            "kept_buffer_blocking_s": round(med(kept["blocking"][1:]), 3),
            "kept_buffer_all_s": [round(x, 3) for x in kept["blocking"]],
            "kept_buffer_ratio": round(med(kept["blocking"][1:]) / med(sync), 3),
            "kept_buffer_rss_after_mb": [round(x) for x in kept["after"]],
            "extra_host_mb": [round(x) for x in asy["extra"]],
            "rss_after_mb": [round(x) for x in asy["after"]],
            "step_s": round(med(plain), 3),
            "overlapped_step_s": round(med(asy["overlapped"]), 3) if asy["overlapped"] else None,
            "overlapped_steps": len(asy["overlapped"]), "load_s": round(load_s, 3)}


def _rank(rank: int, world: int, port: int, sizes: list[str], folder: str, saves: int, out: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import shardwise

    shardwise.init_distributed()
    results = []
    for size in sizes:
        res = _size_run(size, Path(folder) / size, saves)
        if rank == 0:
            print(json.dumps(res), flush=True)
            results.append(res)
            shutil.rmtree(Path(folder) / size, ignore_errors=True)
        dist.barrier()
    if rank == 0 and out:
        Path(out).write_text(json.dumps(results, indent=1) + "\n")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="small,large", help=f"comma-separated, of {sorted(SIZES)}")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--folder", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    sizes = a.sizes.split(",")
    for s in sizes:
        if s not in SIZES:
            p.error(f"--sizes: {s!r} is not one of {sorted(SIZES)}")
    from shardwise.launch.net import free_port

    folder = a.folder or tempfile.mkdtemp(prefix="bench_ckpt_")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(2, free_port(), sizes, folder, a.saves, a.json), nprocs=2, join=True)


if __name__ == "__main__":
    main()
