"""The host memory of a checkpoint save with ``offload_optimizer.device: nvme``: streamed against resident.

    python benchmarks/offload/bench_nvme_save.py --nvme-path /mnt/nvme --save-dir /mnt/nvme/ckpt
    python benchmarks/offload/bench_nvme_save.py --nvme-path /tmp --save-dir /tmp/ckpt --smoke

A Llama (``--hidden``, ``--layers``, ``--vocab``) trained ``--steps`` steps at ``--stage`` with bf16 compute and
its optimizer state (fp32 masters, AdamW's moments) in NVMe swap files, then saved, each mode in a fresh
process: ``streamed`` (the engine's save: the writer reads one group at a time from the swap files,
``checkpoint/deferred.py``) and ``resident`` (every group read into host memory first, then written: the
save before streaming, run through ``OptimizerSwapper.resident``), synchronous and asynchronous. Per mode the
save's (or the load's) peak RSS over the RSS before it (``VmHWM`` reset just before it) and the shard file's sha256,
which must be the same in every mode (the run fails otherwise). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch

MODES = ("resident", "streamed", "resident-async", "streamed-async", "load")


def _vm(field: str) -> int:
    """``/proc/self/status``'s ``field`` in bytes (VmHWM: the peak resident set since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(args) -> None:
    """Train, then one save in ``args.child``'s mode; prints one RESULT line."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import shardwise
    from shardwise.checkpoint import save_checkpoint, wait_for_checkpoint

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                      num_key_value_heads=max(1, args.hidden // 64), max_position_embeddings=args.seq)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 0,
              "bf16": {"enabled": True},
              "zero_optimization": {"stage": args.stage, "reduce_bucket_size": args.bucket,
                                    "allgather_bucket_size": args.bucket,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_path,
                                                          "buffer_count": 2, "pipeline_read": True,
                                                          "pipeline_write": True}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
    engine, *_ = shardwise.initialize(model=AutoModelForCausalLM.from_config(cfg), config=config)
    ids = torch.randint(0, args.vocab, (args.steps, 1, args.seq), generator=torch.Generator().manual_seed(1))
    for s in range(args.steps):
        engine.backward(engine(input_ids=ids[s], labels=ids[s]).loss)
        engine.step()
    state = engine.memory_report()["nvme_offloaded"]
    asynchronous = args.child.endswith("-async")
    before = _vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from the current RSS: the save's peak from here
    if args.child.startswith("resident"):
        with engine.nvme.resident(write_back=False):
            save_checkpoint(engine, args.save_dir, tag=args.child, asynchronous=asynchronous)
    else:
        engine.save_checkpoint(args.save_dir, tag=args.child, asynchronous=asynchronous)
    wait_for_checkpoint()
    peak = _vm("VmHWM")
    if args.child == "load":  # the checkpoint just saved (streamed), loaded back: the load's peak
        before = _vm("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        engine.load_checkpoint(args.save_dir, tag=args.child)
        peak = _vm("VmHWM")
    shard = Path(args.save_dir) / args.child / "rank00000.safetensors"
    sha = hashlib.sha256(shard.read_bytes()).hexdigest()
    out = {"before": before, "peak": peak, "extra": peak - before, "state_bytes": state, "sha256": sha,
           "file_bytes": shard.stat().st_size, "buffers": engine.memory_report()["nvme_buffers"],
           "params": sum(p.numel() for p in engine.module.parameters())}
    engine.destroy()
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--bucket", type=int, default=10_000_000)
    p.add_argument("--smoke", action="store_true", help="tiny sizes")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.bucket = 64, 2, 512, 20_000
    if args.child:
        child(args)
        return
    res = {}
    for mode in MODES:
        argv = [a for a in sys.argv[1:] if a != "--smoke"] + (["--smoke"] if args.smoke else [])
        run = subprocess.run([sys.executable, __file__, *argv, "--child", mode], capture_output=True, text=True,
                             check=False)
        line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
        if run.returncode or not line:
            raise SystemExit(f"{mode}: exit {run.returncode}\n{run.stderr[-3000:]}")
        res[mode] = json.loads(line[0][7:])
    if len({r["sha256"] for r in res.values()}) != 1:
        raise SystemExit(f"shard files differ: { {m: r['sha256'] for m, r in res.items()} }")
    gb = 1e9
    first = res[MODES[0]]
    print(f"{first['params'] / 1e6:.0f}M parameters, optimizer state on NVMe {first['state_bytes'] / gb:.3f} GB, "
          f"shard file {first['file_bytes'] / gb:.3f} GB (the same sha256 in every mode), "
          f"NVMe buffers {first['buffers'] / gb:.3f} GB")
    print("| mode | RSS before | peak RSS during the save (load) | its extra peak |\n|---|---|---|---|")
    for mode, r in res.items():
        print(f"| {mode} | {r['before'] / gb:.3f} GB | {r['peak'] / gb:.3f} GB | {r['extra'] / gb:.3f} GB |")


if __name__ == "__main__":
    sys.exit(main())
