"""The parameter-sharding chapter's walkthrough on real processes (docs/sharding_walkthrough.md).

    shardwise launch --nproc 4 examples/seed_walkthrough.py
    torchrun --standalone --nproc_per_node 4 examples/seed_walkthrough.py   # the same

1. shard a 1024x1024 fp16 tensor W into 4 chunks (one per rank, W.chunk(4, dim=0)) and all-gather
   it back with shardwise's Comm; check it is bit-identical;
2. a sharded Adam step: W as the weight of a model trained by a real shardwise engine at ZeRO stage 1
   (fp16 + fp32 master) and, for comparison, stage 0; print what each rank holds;
3. the estimator's figure for the same Ψ, N and dtype next to the measurement.
Works on CPU (gloo) or GPUs (NCCL); prints from rank 0 only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise.comm import Comm, compute_device
from shardwise.estimate import estimate


def gather_to_rank0(obj):
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def shard_and_gather(device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(64)  # the chapter's seed; every rank builds the same W (only to check the result)
    W = torch.randn(1024, 1024, dtype=torch.float16).to(device)
    shard = W.chunk(world, dim=0)[rank].clone()  # what this rank keeps: (256, 1024)
    comm = Comm()
    full = torch.empty(W.numel(), dtype=W.dtype, device=device)  # 1-D, rank r's shard is chunk r
    full.view_as(W)[rank * shard.shape[0]:(rank + 1) * shard.shape[0]].copy_(shard)
    comm.all_gather(full)
    gathered = full.view_as(W)
    same_bits = torch.equal(gathered.view(torch.int16), W.view(torch.int16))
    info = gather_to_rank0((tuple(shard.shape), shard.numel() * shard.element_size(), same_bits,
                            comm.stats.as_dict()["all_gather"]))
    if rank == 0:
        print(f"== 1. shard W and all-gather it back ({world} ranks, backend {dist.get_backend()})")
        print(f"W: shape {tuple(W.shape)} fp16 = {W.numel() * W.element_size():,} bytes")
        for r, (shape, nbytes, same, moved) in enumerate(info):
            print(f"rank {r}: keeps shard {shape} = {nbytes:,} bytes; after all_gather bit-identical "
                  f"to W: {same} (all_gather counted {moved:,} bytes)")
    if not same_bits:
        raise SystemExit(f"rank {rank}: all-gathered W differs from W")


class OneMatrix(nn.Module):
    """y = x @ W.T with W the chapter's 1024x1024 tensor: Ψ = 1,048,576."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(64)
        self.w = nn.Linear(1024, 1024, bias=False)
        with torch.no_grad():
            self.w.weight.copy_(torch.randn(1024, 1024, dtype=torch.float16).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x).float().pow(2).mean()


def sharded_adam(device: torch.device, stage: int) -> dict[str, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "train_batch_size": 4 * world, "steps_per_print": 0, "gradient_clipping": 0.0,
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2**21, "allgather_bucket_size": 2**21},
    }
    engine, *_ = shardwise.initialize(model=OneMatrix(), config=config)
    g = torch.Generator().manual_seed(rank)  # every rank its own micro batch
    x = torch.randn(4, 1024, generator=g).to(device=device, dtype=torch.float16)
    engine.backward(engine(x))
    engine.step()
    if engine.skipped_steps:
        raise SystemExit("fp16 overflow skipped the step: no optimizer state was created")
    rep = engine.memory_report()
    w = engine.module.w.weight.detach()  # stages 0-2 keep the full fp16 W on every rank
    bits = int(w.view(torch.int16).to(torch.int64).mul(torch.arange(w.numel(), device=w.device)
                                                        .view_as(w).remainder(9973).add(1)).sum())
    return {"report": {k: rep[k] for k in ("params", "grads", "master_params", "optimizer_states")},
            "w_checksum": bits}


def main() -> None:
    shardwise.init_distributed()
    device = compute_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    shard_and_gather(device)

    runs = {stage: gather_to_rank0(sharded_adam(device, stage)) for stage in (0, 1)}
    if rank == 0:
        reports = {stage: [r["report"] for r in per_rank] for stage, per_rank in runs.items()}
        sums = {r["w_checksum"] for per_rank in runs.values() for r in per_rank}
        psi = 1024 * 1024
        print(f"\n== 2. one Adam step on W (Ψ = {psi:,}), fp16 + fp32 master, {world} ranks")
        print("stage  rank  fp16 params  fp16 grads  fp32 master  Adam m+v (fp32)       total")
        for stage, per_rank in reports.items():
            for r, rep in enumerate(per_rank):
                print(f"{stage:>5}  {r:>4}  {rep['params']:>11,}  {rep['grads']:>10,}  "
                      f"{rep['master_params']:>11,}  {rep['optimizer_states']:>15,}  "
                      f"{sum(rep.values()):>10,}")
        m_v_0, m_v_1 = reports[0][0]["optimizer_states"], reports[1][0]["optimizer_states"]
        print(f"Adam m+v per rank: {m_v_1:,} bytes at stage 1 vs {m_v_0:,} unsharded "
              f"(1/{m_v_0 // m_v_1} of it); master {reports[1][0]['master_params']:,} vs "
              f"{reports[0][0]['master_params']:,}")
        print(f"updated W identical on all ranks and at both stages: {len(sums) == 1}")
        print(f"\n== 3. the estimator for the same Ψ, N = {world}, fp16")
        est = estimate(psi, world, dtype="fp16")
        for stage, per_rank in reports.items():
            st = est.stages[stage]
            print(f"stage {stage}: estimated {st.formula} = {st.per_device_bytes:,} bytes per rank, "
                  f"measured {sum(per_rank[0].values()):,}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
