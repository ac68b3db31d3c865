"""A Megatron-style tensor-parallel script passing its own ``mpu`` to initialize, as DeepSpeed
users of Megatron-LM do: the script splits the MLP across the model-parallel group itself and
marks the split parameters (``tensor_model_parallel``, ``partition_dim``); ZeRO shards over the
mpu's data-parallel group. The only change from a DeepSpeed script is the import line.

    shardwise launch --nproc 2 examples/deepspeed_scripts/mpu_tensor_parallel.py --tp 2
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardwise as deepspeed  # was: import deepspeed

HIDDEN, FFN, CLASSES = 16, 32, 4


class MPU:
    """Model-parallel groups of consecutive ranks, data-parallel groups across them (Megatron)."""

    def __init__(self, tp):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, world // tp
        for i in range(self.dp):  # every rank creates every group, in the same order
            g = dist.new_group(list(range(i * tp, (i + 1) * tp)))
            if rank // tp == i:
                self.mp_group = g
        for j in range(tp):
            g = dist.new_group(list(range(j, world, tp)))
            if rank % tp == j:
                self.dp_group = g

    def get_model_parallel_group(self):
        return self.mp_group

    def get_model_parallel_rank(self):
        return dist.get_rank() % self.tp

    def get_model_parallel_world_size(self):
        return self.tp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self):
        return dist.get_rank() // self.tp

    def get_data_parallel_world_size(self):
        return self.dp


class CopyToModelParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        deepspeed.comm.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromModelParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        deepspeed.comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def full_weights(seed=0):
    """The unsplit weights every rank starts from (same seed everywhere)."""
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(FFN, HIDDEN, generator=g) * 0.3, "b1": torch.randn(FFN, generator=g) * 0.1,
            "w2": torch.randn(HIDDEN, FFN, generator=g) * 0.3, "b2": torch.randn(HIDDEN, generator=g) * 0.1,
            "wh": torch.randn(CLASSES, HIDDEN, generator=g) * 0.3, "bh": torch.zeros(CLASSES)}


def _split(t, dim):
    p = nn.Parameter(t.clone())
    p.tensor_model_parallel, p.partition_dim = True, dim
    return p


class ParallelMLP(nn.Module):
    def __init__(self, mpu):
        super().__init__()
        w, tp, r = full_weights(), mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
        rows = FFN // tp
        self.group = mpu.get_model_parallel_group()
        self.w1 = _split(w["w1"][r * rows:(r + 1) * rows], 0)  # column parallel
        self.b1 = _split(w["b1"][r * rows:(r + 1) * rows], 0)
        self.w2 = _split(w["w2"][:, r * rows:(r + 1) * rows], 1)  # row parallel
        self.b2 = nn.Parameter(w["b2"].clone())  # replicated: added after the reduction
        self.head = nn.Linear(HIDDEN, CLASSES)
        with torch.no_grad():
            self.head.weight.copy_(w["wh"])
            self.head.bias.copy_(w["bh"])

    def forward(self, x):
        h = F.gelu(F.linear(CopyToModelParallel.apply(x, self.group), self.w1, self.b1))
        h = ReduceFromModelParallel.apply(F.linear(h, self.w2), self.group) + self.b2
        return self.head(torch.relu(h))


def global_batch(step, size):
    g = torch.Generator().manual_seed(3000 + step)
    x = torch.randn(size, HIDDEN, generator=g)
    return x, x[:, :CLASSES].argmax(dim=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--zero_stage", type=int, default=1)
    args = parser.parse_args()
    deepspeed.init_distributed()
    mpu = MPU(args.tp)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.05,
              "steps_per_print": 0, "zero_optimization": {"stage": args.zero_stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}}
    model = ParallelMLP(mpu)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), mpu=mpu,
                                           config=config)
    dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(args.steps):
        x, y = global_batch(step, micro * dp)
        lo = dp_rank * micro
        loss = F.cross_entropy(engine(x[lo:lo + micro]), y[lo:lo + micro])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        deepspeed.comm.all_reduce(total, group=mpu.get_data_parallel_group())
        if dist.get_rank() == 0:
            print(f"step {step} loss {total.item() / dp:.8f} grad_norm {engine.get_global_grad_norm():.8f}",
                  flush=True)


if __name__ == "__main__":
    main()
