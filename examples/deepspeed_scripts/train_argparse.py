"""A training script written the way DeepSpeed users write it (argparse + add_config_arguments,
``model_parameters=model.parameters()``, the engine's backward/step). The only change from a
DeepSpeed script is the import line.

    shardwise launch --nproc 2 examples/deepspeed_scripts/train_argparse.py \
        --deepspeed --deepspeed_config examples/deepspeed_scripts/ds_config.json
"""

import argparse

import torch
import torch.nn as nn

import shardwise as deepspeed  # was: import deepspeed

HIDDEN, CLASSES = 16, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, 32)
        self.fc2 = nn.Linear(32, 32)
        self.out = nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def global_batch(step, size):
    """The same global batch on every rank (a seeded generator per step); each rank takes a slice."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, HIDDEN, generator=g)
    return x, (x[:, :CLASSES].argmax(dim=1) + (x[:, -1] > 1).long()) % CLASSES


def get_args():
    parser = argparse.ArgumentParser(description="toy classifier")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by launchers")
    parser.add_argument("--steps", type=int, default=12)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = get_args()
    torch.manual_seed(0)
    model = Net()
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(args=args, model=model,
                                                              model_parameters=model.parameters())
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    criterion = nn.CrossEntropyLoss()
    for step in range(args.steps):
        x, y = global_batch(step, micro * gas * world)
        total = torch.zeros(1)
        for m in range(gas):
            lo = (m * world + rank) * micro
            loss = criterion(engine(x[lo:lo + micro]), y[lo:lo + micro])
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        deepspeed.comm.all_reduce(total)
        if rank == 0:
            print(f"step {step} loss {total.item() / world:.8f} lr {lr_scheduler.get_last_lr()[0]:.6f}", flush=True)


if __name__ == "__main__":
    main()
