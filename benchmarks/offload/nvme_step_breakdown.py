"""Where an NVMe-offload iteration's time goes, beside CPU offload's, in one process each.

    python benchmarks/offload/nvme_step_breakdown.py --nvme-path /mnt/nvme [--buffers 2] [--sub-group N]

Trains the bench's Llama (``--hidden``, ``--layers``, ``--vocab``; ZeRO-2, bf16, bucket ``--bucket``) a few
steps with ``offload_optimizer`` on the CPU, then on NVMe, and prints the forward, backward and step
seconds (medians after a warm-up) and, for NVMe, the seconds per step the swapper spent in: the gradient
norm pass (``grad_norm``), waiting for a read (``_drain``) or for a buffer (``_acquire``), loading
gradients (``_grad``), the optimizer (``_step_one`` / ``_step_split``), and ``step_and_publish`` in all.
A step at the disk's floor spends ``step_and_publish - compute`` waiting for reads: the transfers, not
the pipeline, set its length.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time

import torch

WRAPPED = ("grad_norm", "step_and_publish", "_drain", "_acquire", "_grad", "_step_one", "_step_split")


def _timed(spent: dict[str, float]) -> None:
    from shardwise.nvme.swapper import OptimizerSwapper

    for name in WRAPPED:
        f = getattr(OptimizerSwapper, name)

        def wrapper(*a, _f=f, _name=name, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                spent[_name] += time.perf_counter() - t

        setattr(OptimizerSwapper, name, wrapper)


def run(args, device: str, spent: dict[str, float]) -> list[float]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    import shardwise

    torch.manual_seed(0)
    heads = max(1, args.hidden // 64)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=64)
    oo = {"device": device}
    if device == "nvme":
        oo.update(nvme_path=tempfile.mkdtemp(dir=args.nvme_path), buffer_count=args.buffers, pipeline_read=True,
                  pipeline_write=True)
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 0, "bf16": {"enabled": True},
              "aio": {"intra_op_parallelism": 4},
              "zero_optimization": {"stage": 2, "sub_group_size": args.sub_group, "reduce_bucket_size": args.bucket,
                                    "allgather_bucket_size": args.bucket, "offload_optimizer": oo},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
    engine, *_ = shardwise.initialize(model=AutoModelForCausalLM.from_config(cfg), config=config)
    ids = torch.randint(0, args.vocab, (args.steps, 1, 64), generator=torch.Generator().manual_seed(1))
    phases = []
    for s in range(args.steps):
        if s == 1:
            spent.clear()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids[s], labels=ids[s]).loss
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    engine.destroy()
    return [statistics.median(x) for x in zip(*phases[1:], strict=True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--bucket", type=int, default=10_000_000)
    p.add_argument("--buffers", type=int, default=2)
    p.add_argument("--sub-group", type=int, default=1_000_000_000)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    spent: dict[str, float] = collections.defaultdict(float)
    _timed(spent)
    for device in ("cpu", "nvme"):
        fwd, bwd, step = run(args, device, spent)
        print(f"{device:4}: forward {fwd:.3f} s, backward {bwd:.3f} s, step {step:.3f} s, "
              f"iteration {fwd + bwd + step:.3f} s")
    n = args.steps - 1
    print("nvme step, per step: " + ", ".join(f"{k} {v / n:.3f} s" for k, v in spent.items()))


if __name__ == "__main__":
    main()
