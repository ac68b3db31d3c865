"""Activation bytes per rank against sequence length: Ulysses SP 1 and 2, ALST's tiling on and off.

Run on 2 ranks: ``shardwise launch --nproc 2 benchmarks/bench_long_context.py`` (SP 1 runs on rank 0
alone; SP 2 on both). What is measured is *counted*, not timed: the bytes of every tensor autograd
saves for backward during one training forward (``saved_tensors_hooks``; parameters excluded, each
storage once), plus the largest single saved tensor. On CPU, peak RSS hides these (glibc keeps freed
memory), so counted bytes are the honest measure here; they are what fills a GPU at long sequence
lengths. The model is a Llama shaped like a small real one (hidden 512, MLP 1376, vocab 32000, 8
heads, 2 kv heads, 2 layers): big vocab and MLP so the logits and MLP activations weigh as they do
in practice. Also prints the forward + backward seconds of each row (measured under load: the
machine is shared; only the ratios between rows of one run mean anything).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from transformers import AutoModelForCausalLM, LlamaConfig

from shardwise.comm import init_distributed
from shardwise.sequence_parallel import (
    SequenceParallel,
    register_attention,
    sequence_parallel_loss,
    split_batch,
    tile_mlps,
    tiled_causal_lm_loss,
)

VOCAB = 32000


def build(tiled: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 16,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg)
    if tiled:
        tile_mlps(model)
    return model


class Counter:
    """Saved-for-backward bytes of one forward, parameters excluded, each storage counted once."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.seen[ptr] = max(self.seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t


def one_row(seq: int, sp_size: int, tiled: bool, sp: SequenceParallel) -> dict:
    model = build(tiled)
    register_attention(model, sp)
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    counter = Counter(model)
    t0 = time.perf_counter()
    group = None if sp_size == 1 else sp
    with sp.disabled() if sp_size == 1 else contextlib.nullcontext():
        with saved_tensors_hooks(counter.pack, lambda t: t):
            shard = split_batch(batch, group or _Whole())
            labels = shard.pop("shift_labels")
            loss = loss_of(model, shard, labels, group, tiled)
        loss.backward()
    seconds = time.perf_counter() - t0
    return {"seq": seq, "sp": sp_size, "tiled": tiled, "saved_MiB": sum(counter.seen.values()) / 2**20,
            "largest_MiB": max(counter.seen.values()) / 2**20, "seconds": seconds}


def loss_of(model: torch.nn.Module, shard: dict, labels: torch.Tensor, sp: SequenceParallel | None,
            tiled: bool) -> torch.Tensor:
    """The causal-LM loss the way each row computes it (SP 1: the same cross entropy, no group)."""
    if tiled:
        return tiled_causal_lm_loss(model, shard, labels, sp)
    logits = model(**shard).logits
    if sp is not None:
        return sequence_parallel_loss(logits, labels, sp)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


class _Whole:
    """A sequence-parallel group of one, for split_batch at SP 1."""

    size, rank = 1, 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="1024,2048,4096,8192")
    p.add_argument("--out", default=None, help="write the rows as JSON here (rank 0)")
    args = p.parse_args()
    init_distributed(backend="gloo")
    sp = SequenceParallel.of_size(dist.get_world_size())
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for tiled in (False, True):
            if dist.get_rank() == 0:
                rows.append(one_row(seq, 1, tiled, sp))
            dist.barrier()
            row = one_row(seq, sp.size, tiled, sp)
            if dist.get_rank() == 0:
                rows.append(row)
    if dist.get_rank() == 0:
        print("| seq | SP | tiled | saved for backward per rank (MiB) | largest tensor (MiB) | fwd+bwd s |")
        print("| ---: | ---: | --- | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['seq']} | {r['sp']} | {'on' if r['tiled'] else 'off'} | {r['saved_MiB']:.1f} | "
                  f"{r['largest_MiB']:.1f} | {r['seconds']:.2f} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
