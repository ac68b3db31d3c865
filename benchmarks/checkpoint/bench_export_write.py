"""HF export files (``save_16bit_model``, ``shardwise consolidate``) written through shardwise's I/O engine
against the buffered writer they used before.

    python benchmarks/checkpoint/bench_export_write.py --folder /mnt/nvme --mib 512 --rounds 5

One safetensors file of ``--mib`` MiB in 4 MiB bf16 tensors, streamed tensor by tensor as an export does,
by ``checkpoint.fileio.SafetensorsWriter`` (buffered ``write``, fsync at the end) and by
``checkpoint.shard_writer.EngineSafetensorsWriter`` (aligned chunks, hashed, ``pwritev`` on the engine's
threads, O_DIRECT where the filesystem takes it), alternating, ``--rounds`` times each, both fsynced; prints
the median seconds and GB/s, and checks both files' sha256 agree.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from shardwise.checkpoint.fileio import SafetensorsWriter
from shardwise.checkpoint.shard_writer import EngineSafetensorsWriter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", default="/tmp")
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    tensors = {f"w{i}": torch.randn(1 << 21).to(torch.bfloat16) for i in range(max(1, args.mib // 4))}
    specs = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    path = Path(args.folder) / f"bench-export-{os.getpid()}.safetensors"
    times: dict[str, list[float]] = {"buffered": [], "engine": []}
    shas: dict[str, set[str]] = {"buffered": set(), "engine": set()}
    try:
        for _ in range(args.rounds):
            for name, cls in (("buffered", SafetensorsWriter), ("engine", EngineSafetensorsWriter)):
                path.unlink(missing_ok=True)
                t0 = time.perf_counter()
                w = cls(path, specs)
                for k, t in tensors.items():
                    w.write(k, t)
                sha, _size = w.close()
                times[name].append(time.perf_counter() - t0)
                shas[name].add(sha)
    finally:
        path.unlink(missing_ok=True)
    if len(shas["buffered"] | shas["engine"]) != 1:
        raise SystemExit(f"the two writers' files differ: {shas}")
    nbytes = len(tensors) * (4 << 20)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers in shared/
    from shared.timing import median_lines

    print("\n".join(median_lines(times, nbytes, "")))


if __name__ == "__main__":
    main()
