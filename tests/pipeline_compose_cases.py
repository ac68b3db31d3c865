"""Cases for tests/test_pipeline_compose.py: pipeline parallelism composed with tensor and sequence
parallelism, each run with and without stages at the same TP / SP degree and global batch.

The layers are written as a DeepSpeed 3D script writes them (Megatron style): built whole from their
seed, then each keeps its model-parallel slice, read from the grid of the PipelineModule being built
(``shardwise.pipeline.current_grid()``), with Megatron's marks (``tensor_model_parallel``,
``partition_dim``). At model-parallel size 1 they are the plain layers, so the run at 1 rank is the
reference the split runs are compared with. The sequence-parallel layers are a toy Ulysses attention:
tokens of the rank's sequence shard exchanged for heads of the whole sequence and back (DeepSpeed's
``DistributedAttention``), over the grid's ``sp_comm()``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HIDDEN, HEADS, SEQ, BASE_SEED = 8, 16, 4, 8, 1234
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


def _grid():
    from shardwise.pipeline import current_grid

    return current_grid()


class TPMLP(nn.Module):
    """x + fc2(tanh(fc1(x))), fc1 split by output rows (column-parallel), fc2 by input columns (row-parallel)."""

    def __init__(self, width: int = WIDTH, hidden: int = HIDDEN):
        super().__init__()
        full1, full2 = nn.Linear(width, hidden), nn.Linear(hidden, width)
        grid = _grid()
        t, r = grid.get_model_parallel_world_size(), grid.get_model_parallel_rank()
        rows = slice(r * hidden // t, (r + 1) * hidden // t)
        self.w1 = nn.Parameter(full1.weight.detach()[rows].clone())
        self.b1 = nn.Parameter(full1.bias.detach()[rows].clone())
        self.w2 = nn.Parameter(full2.weight.detach()[:, rows].clone())
        self.b2 = nn.Parameter(full2.bias.detach().clone())  # replicated
        for p, dim in ((self.w1, 0), (self.b1, 0), (self.w2, 1)):
            p.tensor_model_parallel, p.partition_dim = True, dim
        self.__dict__["tp"] = grid.tp_comm() if t > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from shardwise.tensor_parallel.layers import copy_to_tp, reduce_from_tp

        h = copy_to_tp(x, self.tp) if self.tp is not None else x
        y = F.linear(torch.tanh(F.linear(h, self.w1, self.b1)), self.w2)
        y = reduce_from_tp(y, self.tp) if self.tp is not None else y
        return x + y + self.b2


class SeqAttention(nn.Module):
    """x + proj(attention(x)) over the whole sequence, this rank holding a shard of it (Ulysses)."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from shardwise.sequence_parallel.exchange import HeadToSeq, SeqToHead

        grid = _grid()
        sp = grid.sp_comm() if grid.get_sequence_parallel_world_size() > 1 else None
        b, s, w = x.shape
        q, k, v = (t.reshape(b, s, self.heads, w // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if sp is not None:  # [b, heads, shard, d] -> [b, heads / sp, whole sequence, d]
            q, k, v = (SeqToHead.apply(t, sp) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(w // self.heads), dim=-1) @ v
        if sp is not None:
            att = HeadToSeq.apply(att, sp)
        return x + self.proj(att.transpose(1, 2).reshape(b, s, w))


def specs(kind: str) -> list:
    from shardwise.pipeline import LayerSpec

    middle = [LayerSpec(TPMLP) for _ in range(4)] if kind == "tp" else [LayerSpec(SeqAttention) for _ in range(4)]
    return [LayerSpec(nn.Linear, WIDTH, WIDTH), *middle, LayerSpec(nn.Linear, WIDTH, WIDTH)]


def data(step: int, replica: int, micro: int, rows: int, shard: int, shards: int) -> tuple:
    """One micro-batch of whole sequences, this SP rank's shard of the tokens."""
    g = torch.Generator().manual_seed(1000 * step + 100 * replica + micro)
    x, y = torch.randn(rows, SEQ, WIDTH, generator=g), torch.randn(rows, SEQ, WIDTH, generator=g)
    part = slice(shard * SEQ // shards, (shard + 1) * SEQ // shards)
    return x[:, part].contiguous(), y[:, part].contiguous()


def train(kind: str, stages: int, tp: int = 1, sp: int = 1, config: dict | None = None, steps: int = 3) -> dict:
    """Each rank: train_batch's losses, eval_batch's loss, its stage's final weights (this model-parallel
    rank's slices) by layer, and ``comm_stats()``'s counts."""
    import shardwise
    from shardwise.pipeline import PipelineModule, PipeModelDataParallelTopology

    config = {**CONFIG, **(config or {}), **({"sequence_parallel_size": sp} if sp > 1 else {})}
    world = torch.distributed.get_world_size()
    topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=tp, num_dp=world // (stages * tp))
    model = PipelineModule(specs(kind), topology=topology, loss_fn=F.mse_loss, seed_layers=True,
                           seed_fn=torch.manual_seed, base_seed=BASE_SEED)
    engine, *_ = shardwise.initialize(model=model, config=config)
    grid = engine.grid
    shard, shards = grid.get_sequence_parallel_rank(), grid.get_sequence_parallel_world_size()
    replica = grid.get_data_parallel_id() // shards
    rows = config["train_micro_batch_size_per_gpu"]
    cast = (lambda b: tuple(t.bfloat16() for t in b)) if config.get("bf16", {}).get("enabled") else None
    engine.set_batch_fn(cast)

    def batch(step: int):
        return iter([data(step, replica, i, rows, shard, shards) for i in range(config["gradient_accumulation_steps"])])

    losses = [engine.train_batch(batch(s)).item() for s in range(steps)]
    evaluated = engine.eval_batch(batch(steps)).item()
    engine.wait_for_params()
    with shardwise.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    stats = engine.comm_stats()
    return {"losses": losses, "eval": evaluated, "weights": weights, "stage": engine.stage_id,
            "tp_rank": grid.get_model_parallel_rank(), "sp_rank": shard, "pipe": list(grid.pp_group),
            "groups": [torch.distributed.get_process_group_ranks(h) for h in (
                grid.get_pipe_parallel_group(), grid.get_data_parallel_group(), grid.get_model_parallel_group())],
            "dp_world": engine.dp_world, "send": stats.get("send", 0), "all_reduce": stats.get("all_reduce", 0),
            "all_to_all": sum(v for k, v in stats.items() if k.startswith("all_to_all"))}


def refused(config: dict, stages: int = 2, tp: int = 1) -> str:
    """The one line ``initialize`` raises for a combination that is not served."""
    import shardwise
    from shardwise.pipeline import PipelineModule, PipeModelDataParallelTopology

    world = torch.distributed.get_world_size()
    topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=tp, num_dp=world // (stages * tp))
    model = PipelineModule(specs("tp"), topology=topology, loss_fn=F.mse_loss)
    try:
        shardwise.initialize(model=model, config={**CONFIG, **config})
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "served"


def train_hf(kind: str, stages: int, parallel: dict, config: dict | None = None, steps: int = 3,
             reduce_once: bool = True) -> dict:
    """A Hugging Face model (``kind``: "mixtral", tests/moe_cases.py without the router aux loss, or "llama",
    tests/tiny_models.py) with ``parallel`` (an ``expert_parallel`` or ``tensor_parallel`` section): split by
    ``pipeline.stages`` and trained with ``train_batch``, or (``stages`` 1) the engine's own loop over the
    same micro-batches. Returns the mean loss per step and this rank's weights (experts gathered, TP
    slices as held) by the model's own names."""
    import moe_cases
    import tiny_models

    import shardwise
    from shardwise.checkpoint import gather_experts

    dp = torch.distributed.get_world_size() // stages // parallel.get("tensor_parallel", {}).get("autotp_size", 1)
    model = moe_cases.build("mixtral", aux=0.0) if kind == "mixtral" else tiny_models.build(kind)
    vocab = moe_cases.VOCAB if kind == "mixtral" else tiny_models.VOCAB
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **parallel, **(config or {})}
    if stages > 1:
        cfg["pipeline"] = {"stages": stages}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    if stages > 1:
        engine.set_reduce_once(reduce_once)
    data = torch.randint(0, vocab, (steps, dp, 2, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for s in range(steps):
        items = [data[s, engine.dp_rank, m:m + 1] for m in range(2)]
        if stages > 1:
            losses.append(float(engine.train_batch(iter([(x, x) for x in items]))))
            continue
        total = torch.zeros(1)
        for x in items:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        total /= 2
        engine.comm.all_reduce(total)
        losses.append(float(total) / dp)
    engine.wait_for_params()
    names = getattr(engine.module, "hf_names", None)
    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {(names[n] if names else n): gather_experts(p.detach().clone(), p).float()
                   for n, p in engine.module.named_parameters()}
    return {"losses": losses, "weights": weights, "ep_world": engine.layout.ep, "tp_world": engine.layout.tp,
            "stage": getattr(engine, "stage_id", 0),
            "all_to_all": sum(v for k, v in engine.comm_stats().items() if k.startswith("all_to_all")),
            "all_reduce": engine.comm_stats().get("all_reduce", 0)}


def hf_refused(config: dict, aux: bool = False) -> str:
    """The one line ``initialize`` raises for a Hugging Face model cut by ``pipeline.stages`` 2 with ``config``
    (``aux``: a Mixtral-style model with its router aux loss on)."""
    import moe_cases
    import tiny_models

    import shardwise

    model = moe_cases.build("mixtral") if aux else tiny_models.build("llama")
    try:
        shardwise.initialize(model=model, config={**CONFIG, "pipeline": {"stages": 2}, **config})
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "served"


def resume(kind: str, folder: str, tp: int = 1, sp: int = 1) -> tuple[list[float], list[float]]:
    """Train 4 batches at PP 2 (saving after 2), load that checkpoint into a new engine of the same layout and
    train batches 3-4 again: (the uninterrupted losses, the resumed ones)."""
    import shardwise
    from shardwise.pipeline import PipelineModule, PipeModelDataParallelTopology

    config = {**CONFIG, "zero_optimization": {"stage": 1}, **({"sequence_parallel_size": sp} if sp > 1 else {})}
    world = torch.distributed.get_world_size()

    def engine_and_batches():
        topology = PipeModelDataParallelTopology(num_pp=2, num_mp=tp, num_dp=world // (2 * tp))
        model = PipelineModule(specs(kind), topology=topology, loss_fn=F.mse_loss, seed_layers=True,
                               seed_fn=torch.manual_seed, base_seed=BASE_SEED)
        engine = shardwise.initialize(model=model, config=config)[0]
        g = engine.grid
        shard, shards = g.get_sequence_parallel_rank(), g.get_sequence_parallel_world_size()
        return engine, lambda s: iter([data(s, g.get_data_parallel_id() // shards, i, 2, shard, shards)
                                       for i in range(4)])

    first, batch = engine_and_batches()
    losses = []
    for s in range(4):
        if s == 2:
            first.save_checkpoint(folder, tag="half")
        losses.append(float(first.train_batch(batch(s))))
    second, batch = engine_and_batches()
    second.load_checkpoint(folder, tag="half")
    return losses[2:], [float(second.train_batch(batch(s))) for s in (2, 3)]


def reshard(folder: str) -> list[float]:
    """Train 2 batches at PP 2 x TP 2 and save; load that checkpoint at PP 1 x TP 2 x DP 2 and at PP 2 x DP 2
    (no TP). Each layout's eval loss on one batch (every replica the same): the saving run's, then the two
    loads' (the same model in each, if every slice went where it belongs)."""
    import shardwise
    from shardwise.pipeline import PipelineModule, PipeModelDataParallelTopology

    config = {**CONFIG, "zero_optimization": {"stage": 1}}
    world = torch.distributed.get_world_size()
    batch = [data(9, 0, i, 2, 0, 1) for i in range(4)]
    out = []
    for i, (stages, tp) in enumerate(((2, 2), (1, 2), (2, 1))):
        topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=tp, num_dp=world // (stages * tp))
        model = PipelineModule(specs("tp"), topology=topology, loss_fn=F.mse_loss, seed_layers=True,
                               seed_fn=torch.manual_seed, base_seed=BASE_SEED)
        engine = shardwise.initialize(model=model, config=config)[0]
        if i == 0:
            for s in range(2):
                engine.train_batch(iter([data(s, engine.grid.get_data_parallel_id(), m, 2, 0, 1) for m in range(4)]))
            engine.save_checkpoint(folder, tag="t")
        else:
            engine.load_checkpoint(folder, tag="t")
        out.append(float(engine.eval_batch(iter(batch))))
    return out
