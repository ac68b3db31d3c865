"""Ring attention against Ulysses at SP 2: bytes saved for backward, bytes sent, seconds per step.

Run on 2 ranks: ``shardwise launch --nproc 2 benchmarks/long_context/bench_ring_attention.py``. The model is
bench_long_context.py's Llama (hidden 512, 8 heads, 2 kv heads, 2 layers, vocab 32000), untiled,
batch 1; both modes run the same split batch on the same model. Counted per rank: the bytes autograd
saves in one training forward (each storage once, parameters excluded), the bytes the SP group's
exchanges send in one forward + backward (``CommStats``: Ulysses' all-to-alls, the ring's
rotations), and the forward + backward seconds (measured under load on a shared machine: only ratios
within one run mean anything). Not counted: transient tensors (the ring's per-chunk-pair scores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks

sys.path.insert(0, str(Path(__file__).parent))
from bench_long_context import VOCAB, Counter, build  # noqa: E402

from shardwise.comm import init_distributed  # noqa: E402
from shardwise.sequence_parallel import (  # noqa: E402
    SequenceParallel,
    register_attention,
    sequence_parallel_loss,
    split_batch,
)


def _sent(sp: SequenceParallel) -> int:
    return sum(v for k, v in sp.comm.stats.bytes.items() if k.startswith(("all_to_all", "ring")))


def one_row(seq: int, mode: str, sp: SequenceParallel) -> dict:
    model = build(False)
    register_attention(model, sp, mode)
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    shard = split_batch({"input_ids": ids, "labels": ids}, sp)
    labels = shard.pop("shift_labels")
    counter, before = Counter(model), _sent(sp)
    dist.barrier()
    t0 = time.perf_counter()
    with saved_tensors_hooks(counter.pack, lambda t: t):
        loss = sequence_parallel_loss(model(**shard).logits, labels, sp)
    loss.backward()
    seconds = time.perf_counter() - t0
    return {"seq": seq, "mode": sp.attention, "saved_MiB": sum(counter.seen.values()) / 2**20,
            "sent_MiB": (_sent(sp) - before) / 2**20, "seconds": seconds, "loss": float(loss.detach())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="1024,2048,4096")
    p.add_argument("--rounds", type=int, default=2, help="rows per (seq, mode); the fastest is kept")
    args = p.parse_args()
    init_distributed(backend="gloo")
    sp = SequenceParallel.of_size(dist.get_world_size())
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for mode in ("ulysses", "ring"):
            runs = [one_row(seq, mode, sp) for _ in range(args.rounds)]
            rows.append(min(runs, key=lambda r: r["seconds"]))
    if dist.get_rank() == 0:
        print("| seq | SP 2 attention | saved for backward per rank (MiB) | sent per rank, fwd+bwd (MiB) | "
              "fwd+bwd s | loss |")
        print("| ---: | --- | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['seq']} | {r['mode']} | {r['saved_MiB']:.1f} | {r['sent_MiB']:.2f} | {r['seconds']:.2f} | "
                  f"{r['loss']:.6f} |")


if __name__ == "__main__":
    main()
