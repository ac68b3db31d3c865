"""TP=2 forward+backward step time: shardwise.tensor_parallel vs torch DTensor ``parallelize_module``.

Same ~20M-parameter Llama, 2 gloo ranks on CPU, one invocation: ``python benchmarks/tensor_parallel/bench_tp.py``.
Both shard q/k/v/gate/up column-wise and o/down row-wise, the embedding by vocabulary and the head
column-wise (DTensor: ``RowwiseParallel(input_layouts=Replicate())`` / ``ColwiseParallel(
output_layouts=Replicate())``); each uses its natural loss (shardwise: vocab-parallel CE).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _model(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg)


def _dtensor(model, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    return parallelize_module(model, mesh, plan)


def _time(model, ids, steps: int, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return times


def _worker(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    import shardwise
    from shardwise.layout import get_mesh
    from shardwise.tensor_parallel import apply_tensor_parallel

    shardwise.init_distributed(backend="gloo")
    ids = torch.randint(0, 8000, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    out = {}
    for name in args.order.split(","):
        model = _model()
        if name == "shardwise":
            apply_tensor_parallel(model, get_mesh(world).tp)
        else:
            model = _dtensor(model, world)
        out[name] = statistics.median(_time(model, ids, args.steps, args.warmup))
        del model
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--order", default="shardwise,dtensor")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, port, args, results), nprocs=2)
    n = sum(p.numel() for p in _model().parameters())
    sw, dt = results["shardwise"], results["dtensor"]
    print(f"Llama {n / 1e6:.1f}M params, TP=2 gloo, batch {args.batch} x seq {args.seq}, median of {args.steps}")
    print(f"shardwise step {sw * 1e3:.1f} ms  DTensor step {dt * 1e3:.1f} ms  ratio {sw / dt:.3f}x")


if __name__ == "__main__":
    main()
