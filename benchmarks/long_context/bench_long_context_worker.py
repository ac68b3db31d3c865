"""One launch of bench_long_context.py: one implementation at one SP degree (world size = SP degree).

Run by the driver under torchrun (``--nproc-per-node N`` for SP ``N``, ``OMP_NUM_THREADS=1``); every
rank runs the same code and rank 0 writes the JSON. For each of ALST's tiling off and on it builds
the model, registers the implementation's Ulysses attention (SP > 1), and measures:

- the live saved-for-backward bytes per rank at the fixed lengths of ``--seqs`` (forward only);
- the longest length whose bytes fit ``--budget-mib`` per rank, searched by measurement (below);
- one full forward + backward at that longest length (it trains: a finite loss and gradients).

What is counted: every tensor autograd saves for backward during one training forward
(``saved_tensors_hooks``), parameters excluded, each storage once, and of those only the storages
still alive when the forward returns (``StorageWeakRef``): the activations a device holds at the
start of backward, its peak for activations. A tile's tensors saved and freed inside the forward
(DeepSpeed's ``TiledFusedLogitsLoss`` runs each tile's backward there) are not held at once, so
they are not counted; ``ever_MiB`` keeps the sum over every storage ever saved for comparison.
The value reported is the largest over the ranks (they hold equal shards). Not counted: weights,
gradients and optimizer state (ZeRO's), and the backward's transient buffers (untiled: the logits'
gradient, ``[s/N, V]`` fp32; tiled: one tile's logits, softmax and gradient, a fixed size).

Measured as well, at the fixed lengths and at the longest one (one forward + backward each): the
peak of the process's heap in use (glibc ``mallinfo2``: bytes handed out and not freed, so unlike
RSS it drops when tensors are freed) above its value just before the forward, sampled after every
aten op of the forward and the backward (``TorchDispatchMode``), with the parameters' gradients
allocated beforehand (model state, ZeRO's). It includes what the count leaves out (the backward's
transients, the freshly computed gradient of each weight before it is added in place) and misses
only an op's own temporaries. ``heap_peak_MiB`` is null where glibc's ``mallinfo2`` is missing.

The search (``longest``): probes at ``start`` tokens (and ``2 start`` if it fits), then at the length where the
line through the two nearest measured points crosses the budget (rounded down to the granule),
bisecting when a step did not shrink the bracket by half; it stops when a length ``L`` that fits
and ``L + granule`` that does not were both measured. Every probe is kept in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB, HIDDEN, MLP, LAYERS, HEADS, KV_HEADS = 32000, 512, 1376, 2, 8, 2
MODEL = (f"Llama, hidden {HIDDEN}, MLP {MLP}, vocab {VOCAB}, {HEADS} heads, {KV_HEADS} kv heads, "
         f"{LAYERS} layers, fp32, sdpa, batch 1")
MIB = 2**20


def build_model() -> torch.nn.Module:
    """The same weights in every launch (seed 0), untied head: the logits weigh as in a real model."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1 << 17,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg)


def make_batch(seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq).unsqueeze(0)}


def tiles_for(local_seq: int) -> int:
    """ALST's tile count, the same for both implementations: one tile per ``hidden`` tokens."""
    return max(1, math.ceil(local_seq / HIDDEN))


class SavedBytes:
    """Saved-for-backward storages of one forward: parameters excluded, each storage once."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.ever: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.params or nbytes == 0:
            return t
        self.ever[ptr] = max(self.ever.get(ptr, 0), nbytes)
        old = self.live.get(ptr)
        if old is None or old[0].expired() or old[1] < nbytes:
            self.live[ptr] = (StorageWeakRef(storage), nbytes)
        return t

    def totals(self) -> tuple[float, float, float]:
        """(live MiB, largest live tensor MiB, MiB ever saved), now."""
        alive = [n for ref, n in self.live.values() if not ref.expired()]
        return sum(alive) / MIB, max(alive, default=0) / MIB, sum(self.ever.values()) / MIB


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():  # noqa: ANN202
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


MALLINFO2 = _mallinfo2()


def heap_in_use() -> int:
    """Bytes glibc has handed out and not had back (small-chunk heap plus mmapped blocks)."""
    m = MALLINFO2()
    return m.uordblks + m.hblkhd


class HeapPeak(TorchDispatchMode):
    """The largest ``heap_in_use()`` seen after any aten op run while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.peak = heap_in_use()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, heap_in_use())
        return out


class ShardwiseSP:
    """shardwise's Ulysses SP and tiled pieces (shardwise.sequence_parallel)."""

    name = "shardwise"

    def __init__(self, sp_size: int):
        from shardwise.comm import init_distributed
        from shardwise.sequence_parallel import SequenceParallel

        init_distributed(backend="gloo")
        self.sp = SequenceParallel.of_size(sp_size)
        self.version = "this checkout"

    def prepare(self, model: torch.nn.Module, tiled: bool) -> None:
        from shardwise.sequence_parallel import register_attention, tile_mlps

        if self.sp.size > 1:
            register_attention(model, self.sp)
        if tiled:
            tile_mlps(model)

    def shard(self, batch: dict) -> tuple[dict, torch.Tensor]:
        from shardwise.sequence_parallel import split_batch

        shard = split_batch(batch, self.sp)  # tensors only; the SP hook turns the KV cache off at SP > 1,
        labels = shard.pop("shift_labels")
        return {**shard, "use_cache": False}, labels  # and this at SP 1 (no hook), as split_batch did

    def loss(self, model: torch.nn.Module, inputs: dict, labels: torch.Tensor, tiled: bool) -> torch.Tensor:
        from shardwise.sequence_parallel import sequence_parallel_loss, tiled_causal_lm_loss

        if tiled:
            return tiled_causal_lm_loss(model, inputs, labels, self.sp)
        return sequence_parallel_loss(model(**inputs).logits, labels, self.sp)


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure(model: torch.nn.Module, impl, seq: int, tiled: bool, train: bool = False) -> dict:  # noqa: ANN001
    """Count one forward's live saved bytes at ``seq`` tokens (whole sequence); ``train``: backward too,
    and the heap's peak over both."""
    inputs, labels = impl.shard(make_batch(seq))
    counter = SavedBytes(model)
    if train:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    gc.collect()
    base = heap_in_use() if MALLINFO2 else 0
    peak = HeapPeak() if train and MALLINFO2 else contextlib.nullcontext()
    t0 = time.perf_counter()
    with peak, saved_tensors_hooks(counter.pack, lambda t: t):
        loss = impl.loss(model, inputs, labels, tiled)
    live, largest, ever = counter.totals()
    row = {"seq": seq}
    if train:
        with peak:
            loss.backward()
        row.update(loss=loss.item(), grads_finite=all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
    seconds = time.perf_counter() - t0
    heap = (peak.peak - base) / MIB if isinstance(peak, HeapPeak) else -1.0
    live, largest, ever, seconds, heap = _max_over_ranks([live, largest, ever, seconds, heap])
    row.update(live_MiB=live, largest_MiB=largest, ever_MiB=ever, seconds=seconds,
               heap_peak_MiB=heap if heap >= 0 else None)
    del loss
    model.zero_grad(set_to_none=True)
    gc.collect()
    return row


def _next_probe(points: dict[int, float], lo: int | None, hi: int | None, budget: float, g: int,
                bisect: bool) -> int:
    """The next length to measure: the budget crossing of the line through the nearest points."""
    if lo is not None and hi is not None:
        if bisect:
            guess = (lo + hi) // 2
        else:
            guess = lo + (budget - points[lo]) * (hi - lo) / (points[hi] - points[lo])
        return min(max(int(guess) // g * g, lo + g), hi - g)
    near = sorted(points)[-2:] if hi is None else sorted(points)[:2]
    a, b = near[0], near[-1]
    slope = (points[b] - points[a]) / (b - a) if b != a else points[a] / a
    guess = int(b + (budget - points[b]) / slope) // g * g if slope > 0 else 4 * b
    if hi is None:
        return min(max(guess, lo + g), 4 * lo)
    return max(min(guess, hi - g), g)


def longest(probe: Callable[[int], float], budget: float, start: int, g: int, max_probes: int = 16) -> int:
    """The longest multiple of ``g`` whose measured bytes fit ``budget``: ``L`` fits and ``L + g`` does not."""
    points: dict[int, float] = {}
    lo = hi = None
    seq, widths = start, []
    for i in range(max_probes):
        points[seq] = probe(seq)
        if points[seq] <= budget:
            lo = seq if lo is None else max(lo, seq)
        else:
            hi = seq if hi is None else min(hi, seq)
        if hi is not None and hi <= g:
            return 0
        if lo is not None and hi is not None and hi - lo <= g:
            return lo
        widths.append(None if lo is None or hi is None else hi - lo)
        slow = len(widths) >= 2 and None not in widths[-2:] and widths[-1] > widths[-2] / 2
        seq = 2 * start if i == 0 and hi is None else _next_probe(points, lo, hi, budget, g, slow)
    raise RuntimeError(f"longest: no bracket of width {g} after {max_probes} probes: {points}")


def run_one(impl, tiled: bool, args: argparse.Namespace) -> dict:  # noqa: ANN001
    model = build_model()
    impl.prepare(model, tiled)
    sp, g = args.sp, args.granule * args.sp
    rows = [measure(model, impl, s, tiled, train=True) for s in args.seqs]
    probes: list[dict] = []

    def probe(seq: int) -> float:
        probes.append(measure(model, impl, seq, tiled))
        return probes[-1]["live_MiB"]

    best = longest(probe, args.budget_mib, args.first * sp, g)
    check = measure(model, impl, best, tiled, train=True) if best else None
    run = {"impl": impl.name, "version": impl.version, "sp": sp, "tiled": tiled, "rows": rows,
           "budget_MiB": args.budget_mib, "granule": g, "longest": best, "probes": probes, "train_check": check}
    if args.heap_budget_mib > 0 and MALLINFO2:
        trained: list[dict] = []

        def heap_probe(seq: int) -> float:
            trained.append(measure(model, impl, seq, tiled, train=True))
            return trained[-1]["heap_peak_MiB"]

        run.update(heap_budget_MiB=args.heap_budget_mib, heap_probes=trained,
                   heap_longest=longest(heap_probe, args.heap_budget_mib, args.first * sp, g))
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("shardwise", "deepspeed"), default="shardwise")
    p.add_argument("--sp", type=int, required=True, help="the SP degree (= the world size of this launch)")
    p.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",") if x], default=[1024, 2048, 4096])
    p.add_argument("--budget-mib", type=float, default=128.0)
    p.add_argument("--heap-budget-mib", type=float, default=0.0, help="also search by the heap's peak (0: no)")
    p.add_argument("--first", type=int, default=512, help="first probe, tokens per rank")
    p.add_argument("--granule", type=int, default=16, help="search resolution, tokens per rank")
    p.add_argument("--tiled", default="off,on")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.impl == "deepspeed":
        from bench_long_context_ds import DeepSpeedSP

        impl = DeepSpeedSP(args.sp, tiles_for)
    else:
        impl = ShardwiseSP(args.sp)
    if dist.get_world_size() != args.sp:
        raise SystemExit(f"launch with --nproc-per-node {args.sp} (the SP degree), not {dist.get_world_size()}")
    runs = [run_one(impl, mode == "on", args) for mode in args.tiled.split(",")]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
