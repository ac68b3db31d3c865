"""Checkpoints with ``client_state``, written as DeepSpeed users write them: save the engine with
the script's own state (here the step and a running statistic), load both back, continue. The
only change from a DeepSpeed script is the import line.

    shardwise launch --nproc 2 examples/deepspeed_scripts/checkpoint_resume.py \
        --deepspeed_config examples/deepspeed_scripts/ds_config.json --ckpt_dir /tmp/ck --save_at 4
    shardwise launch --nproc 2 examples/deepspeed_scripts/checkpoint_resume.py \
        --deepspeed_config examples/deepspeed_scripts/ds_config.json --ckpt_dir /tmp/ck --resume
"""

import argparse

import torch
import torch.nn as nn

import shardwise as deepspeed  # was: import deepspeed

HIDDEN = 16


def global_batch(step, size):
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(size, HIDDEN, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ckpt_dir", required=True)
    parser.add_argument("--save_at", type=int, default=-1, help="save after this step")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, 32), nn.Tanh(), nn.Linear(32, 1))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    start, seen = 0, 0
    if args.resume:
        path, client_state = engine.load_checkpoint(args.ckpt_dir)
        start, seen = client_state["step"] + 1, client_state["samples_seen"]
        if rank == 0:
            print(f"resumed from {path} at step {start} (samples seen {seen})", flush=True)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    for step in range(start, args.steps):
        x, y = global_batch(step, micro * gas * world)
        total = torch.zeros(1)
        for m in range(gas):
            lo = (m * world + rank) * micro
            loss = nn.functional.mse_loss(engine(x[lo:lo + micro]), y[lo:lo + micro])
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        seen += x.shape[0]
        deepspeed.comm.all_reduce(total)
        if rank == 0:
            print(f"step {step} loss {total.item() / world:.8f}", flush=True)
        if step == args.save_at:
            engine.save_checkpoint(args.ckpt_dir, client_state={"step": step, "samples_seen": seen})
    if rank == 0:
        print(f"samples seen {seen} global steps {engine.global_steps}", flush=True)


if __name__ == "__main__":
    main()
