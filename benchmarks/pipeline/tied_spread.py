"""How far PP 2 is from PP 1 with a weight tied across the stages: DeepSpeed's and shardwise's.

A ``PipelineModule`` of 8 layers (a square projection whose weight the head reuses through
``forward_fn``, 6 Linear + tanh blocks between), seeded by layer index, AdamW, 4 micro-batches of 2
rows a batch; one data-parallel replica, so PP 1 (one rank) and PP 2 (two ranks) see the same data.
Each run writes its losses and final weights to ``OUT/{engine}_pp{P}.pt``; ``--compare`` prints the
largest relative difference of the losses and of the weights (element by element) between two runs::

    # DeepSpeed (a venv with it; gloo on CPU), then shardwise's facade (the same script):
    for n in 1 2; do DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run \\
        --nproc-per-node $n benchmarks/pipeline/tied_spread.py --out /tmp/spread; done
    for n in 1 2; do OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node $n \\
        benchmarks/pipeline/tied_spread.py --shardwise --out /tmp/spread; done
    python benchmarks/pipeline/tied_spread.py --compare /tmp/spread/deepspeed_pp1.pt /tmp/spread/deepspeed_pp2.pt

``--batch-order`` (shardwise only) sends the tied gradients once a batch (``set_tied_exact(False)``).
The results are in docs/pipeline.md ("Tied layers across stages").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WIDTH, BLOCKS, SEED = 8, 6, 1234
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "zero_allow_untested_optimizer": True,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def head(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight


def batch(step: int):
    for i in range(CONFIG["gradient_accumulation_steps"]):
        g = torch.Generator().manual_seed(1000 * step + i)
        yield torch.randn(2, WIDTH, generator=g), torch.randn(2, WIDTH, generator=g)


def run(args: argparse.Namespace) -> None:
    if args.shardwise:
        import shardwise

        shardwise.install_as_deepspeed()
    import deepspeed
    from deepspeed import pipe

    deepspeed.init_distributed(dist_backend="gloo")
    layers = [pipe.TiedLayerSpec("proj", nn.Linear, WIDTH, WIDTH, bias=False),
              *[pipe.LayerSpec(Block) for _ in range(BLOCKS)],
              pipe.TiedLayerSpec("proj", nn.Linear, WIDTH, WIDTH, bias=False, forward_fn=head)]
    model = pipe.PipelineModule(layers, num_stages=dist.get_world_size(), loss_fn=F.mse_loss, seed_layers=True,
                                seed_fn=torch.manual_seed, base_seed=SEED)
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    if args.batch_order:
        engine.set_tied_exact(False)
    losses = [float(engine.train_batch(batch(s))) for s in range(args.steps)]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, weights)
    if dist.get_rank() == 0:
        name = ("shardwise" + ("_batch" if args.batch_order else "")) if args.shardwise else "deepspeed"
        Path(args.out).mkdir(parents=True, exist_ok=True)
        torch.save({"losses": losses, "weights": {k: v for w in gathered for k, v in w.items()}},
                   Path(args.out) / f"{name}_pp{dist.get_world_size()}.pt")


def compare(a: str, b: str) -> None:
    x, y = torch.load(a), torch.load(b)
    loss = max(abs(p - q) / abs(p) for p, q in zip(x["losses"], y["losses"], strict=True))
    weight = max(float(((x["weights"][n] - y["weights"][n]).abs() / x["weights"][n].abs().clamp_min(1e-12)).max())
                 for n in x["weights"])
    print(f"{Path(a).name} vs {Path(b).name}: losses {loss:.2e} relative, weights {weight:.2e} relative "
          f"(largest over elements), {len(x['losses'])} batches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shardwise", action="store_true", help="run on shardwise's facade")
    parser.add_argument("--batch-order", action="store_true", help="shardwise: tied gradients once a batch")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="/tmp/tied_spread")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        run(args)


if __name__ == "__main__":
    main()
