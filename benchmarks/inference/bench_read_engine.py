"""ZeRO-Inference's safetensors reads through shardwise's I/O engine against a direct ``preadv`` loop.

    python benchmarks/inference/bench_read_engine.py --folder /tmp --mib 256 --rounds 5

``files/safetensors_io.read_into`` reads through ``shardwise.aio.shared_engine().read_now`` (the engine's
calls, checks and counters on the calling thread). This measures what that costs: ``--mib`` MiB written
as 4 MiB tensors to one safetensors file, then read back tensor by tensor into one reused buffer,
alternating the engine path and a plain ``os.preadv`` loop (the former ``read_into``), ``--rounds`` times
each; prints the median seconds and
GB/s of each (the page cache warm after the first round: the hop's cost, not the disk, is measured).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from shardwise.files import safetensors_io as sio


def direct_read_into(fd: int, pos: int, dst: torch.Tensor, what: str) -> None:
    """The former ``read_into``: ``preadv`` on the calling thread straight into ``dst``."""
    size = dst.numel() * dst.element_size()
    buf = memoryview((ctypes.c_char * size).from_address(dst.data_ptr())).cast("B")
    done = 0
    while done < size:
        n = os.preadv(fd, [buf[done:]], pos + done)
        if n <= 0:
            raise OSError(f"short read of {what}")
        done += n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", default="/tmp")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    path = Path(args.folder) / f"bench-read-engine-{os.getpid()}.safetensors"
    names = [f"w{i}" for i in range(max(1, args.mib // 4))]
    save_file({n: torch.randn(1 << 20) for n in names}, str(path))
    engine_read_into, out = sio.read_into, torch.empty(1 << 20)
    times: dict[str, list[float]] = {"engine": [], "direct preadv": []}
    try:
        with sio.SafetensorsFile(path) as f:
            for _ in range(args.rounds):
                for name, fn in (("engine", engine_read_into), ("direct preadv", direct_read_into)):
                    sio.read_into = fn
                    t0 = time.perf_counter()
                    for n in names:
                        f.read(n, 0, 1 << 20, out)
                    times[name].append(time.perf_counter() - t0)
    finally:
        sio.read_into = engine_read_into
        path.unlink()
    nbytes = len(names) * (4 << 20)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers in shared/
    from shared.timing import median_lines

    print("\n".join(median_lines(times, nbytes, f" in {len(names)} reads")))


if __name__ == "__main__":
    main()
