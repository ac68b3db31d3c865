"""`shardwise train`: the main job, a small Llama trained on shipped text under any config.

Builds the model from a config (no download), tokenizes bytes (no tokenizer
download), shows a rank-0 progress bar with loss and tokens/s, and ends with a
per-rank memory table from ``engine.memory_report()``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from shardwise.cli_errors import OneLineParser, UserError, bounded_int, positive_float

REPO_DATA = Path(__file__).resolve().parent.parent / "data" / "sonnets.txt"

MODEL_PRESETS = {
    # ~3M parameters: about two minutes for 400 steps on 2 CPU ranks.
    "llama-tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2),
    # ~20M parameters: the benchmark model.
    "llama-20m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4),
}


class ByteTextDataset(Dataset):
    """Fixed-length windows of a text's UTF-8 bytes (vocabulary 256)."""

    def __init__(self, path: Path, seq_len: int):
        data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
        n = (len(data) - 1) // seq_len
        if n < 1:
            raise UserError(f"{path} is shorter than one sequence of {seq_len} bytes (--seq)")
        # overlapping windows at a stride of seq_len // 2 double the samples of a tiny text
        stride = max(1, seq_len // 2)
        starts = range(0, len(data) - seq_len - 1, stride)
        self.samples = [data[s:s + seq_len] for s in starts]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.samples[i], "labels": self.samples[i]}


def build_model(preset: str, seq_len: int, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if preset not in MODEL_PRESETS:
        raise ValueError(f"--model {preset!r} is unknown; choose one of {sorted(MODEL_PRESETS)}")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, max_position_embeddings=max(seq_len, 256), tie_word_embeddings=False,
                      **MODEL_PRESETS[preset])
    return AutoModelForCausalLM.from_config(cfg)


def memory_table(rows: list[dict[str, int]]) -> str:
    keys = ["params", "grads", "master_params", "optimizer_states", "buffers", "total"]
    head = f"{'rank':>4} " + " ".join(f"{k:>16}" for k in keys)
    lines = [head, "-" * len(head)]
    for r, rep in enumerate(rows):
        lines.append(f"{r:>4} " + " ".join(f"{rep[k] / 2**20:>13.2f} MiB" for k in keys))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before any process group starts (user errors exit 2, one line)."""
    p = OneLineParser(prog="shardwise train", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""examples:
  shardwise launch --nproc 2 -- train --config examples/zero2_llama.json
  shardwise launch --nproc 2 -- train --config examples/zero1_llama.json --steps 50 --model llama-20m""")
    p.add_argument("--config", required=True, help="DeepSpeed-style JSON config")
    p.add_argument("--model", default="llama-tiny", choices=sorted(MODEL_PRESETS), help="model preset")
    p.add_argument("--data", default=str(REPO_DATA), help="a UTF-8 text file (default: shipped sonnets)")
    p.add_argument("--seq", type=bounded_int(2, 1 << 20, "--seq"), default=128, help="sequence length in bytes")
    p.add_argument("--steps", type=bounded_int(1, 10**9, "--steps"), default=400, help="optimizer steps")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=positive_float, default=None,
                   help="seconds a collective may wait before every rank fails (default 600; SHARDWISE_TIMEOUT)")
    args = p.parse_args(argv)
    for flag, path in (("--config", args.config), ("--data", args.data)):
        if not Path(path).is_file():
            p.error(f"{flag} {path!r}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from tqdm import tqdm

    import shardwise

    shardwise.init_distributed(timeout=args.timeout)
    rank = dist.get_rank()
    model = build_model(args.model, args.seq, args.seed)
    dataset = ByteTextDataset(Path(args.data), args.seq)
    n_params = sum(p.numel() for p in model.parameters())  # before TP or ZeRO cut the model
    engine, _, loader, _ = shardwise.initialize(model=model, config=args.config, training_data=dataset)
    cfg = engine.config
    if rank == 0:
        print(f"[shardwise] {args.model}: {n_params / 1e6:.2f}M params, world {dist.get_world_size()} "
              f"(tp {engine.tp.size} x dp {engine.dp_world}), "
              f"ZeRO stage {engine.stage}, {cfg.precision}, micro batch {cfg.train_micro_batch_size_per_gpu}"
              f" x accumulation {engine.gas} x dp {engine.dp_world} = {cfg.train_batch_size} sequences/step",
              flush=True)
    bar = tqdm(total=args.steps, disable=rank != 0, unit="step", dynamic_ncols=True)
    tokens_per_step = cfg.train_batch_size * args.seq
    epoch, t0, done = 0, time.perf_counter(), 0
    while done < args.steps:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            out = engine(**batch)
            engine.backward(out.loss)
            engine.step()
            if engine.micro_steps % engine.gas == 0:  # an optimizer step just happened
                done += 1
                rate = done * tokens_per_step / (time.perf_counter() - t0)
                bar.set_postfix(loss=f"{out.loss.item():.3f}", tok_s=f"{rate:,.0f}")
                bar.update(1)
                if done >= args.steps:
                    break
        epoch += 1
    bar.close()
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, engine.memory_report())
    if rank == 0:
        print(f"final loss {out.loss.item():.4f} after {done} steps, "
              f"{done * tokens_per_step / (time.perf_counter() - t0):,.0f} tokens/s")
        print("model-state memory per rank (tensor bytes):")
        print(memory_table(reports))
        print("communication per rank:", json.dumps(engine.comm_stats()))
    dist.destroy_process_group()
    return 0
