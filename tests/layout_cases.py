"""Run-layout cases run on every rank of a pool (tests/test_run_layout.py): one step at SP 2 or EP 2
through ``shardwise.initialize``, and what every byte counter says about its all-to-alls."""

from __future__ import annotations

import moe_cases
import sp_cases
import torch.distributed as dist

import shardwise
from shardwise.comm.log import COMMS_LOG
from shardwise.comm.log import configure as configure_comms_log
from shardwise.moe import apply_expert_parallel
from shardwise.sequence_parallel import sequence_parallel_loss, split_batch


def _logged_all_to_all() -> int:
    """The comms logger's bytes for its all-to-all rows (every group's, every kind counted as one)."""
    return sum(s["total_bytes"] for op, sizes in COMMS_LOG.summary().items() if op.startswith("all_to_all")
               for s in sizes.values())


def _one_step(engine, run) -> dict:  # noqa: ANN001
    """``run()`` (forward + backward + step) with the comms logger on; the counters' growth."""
    COMMS_LOG.reset()
    before = dict(engine.comm_stats())
    try:
        run()
        after = dict(engine.comm_stats())
        logged = _logged_all_to_all()
    finally:
        configure_comms_log(enabled=False)  # the pool's next cases run without the logger
        COMMS_LOG.reset()
    return {"stats": {k: v - before.get(k, 0) for k, v in after.items()}, "logged_all_to_all": logged,
            "layout": engine.layout.degrees()}


def sp_step(stage: int, seq: int = 16, micro: int = 2) -> dict:
    """One step at SP 2 (a Llama of 4 heads, 2 kv heads, head dim 16, 2 layers)."""
    model = sp_cases.llama(kv_heads=2, heads=4)
    cfg = sp_cases.sp_config(stage, 2, dist.get_world_size(), micro=micro)
    cfg["comms_logger"] = {"enabled": True}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    sp = engine.sequence_parallel
    shard = split_batch(sp_cases.sample_batch(micro, seq, seed=7), sp)
    labels = shard.pop("shift_labels")

    def run() -> None:
        engine.backward(sequence_parallel_loss(engine(**shard).logits, labels, sp))
        engine.step()

    c = model.config
    out = _one_step(engine, run)
    out.update(batch=micro, local_tokens=int(shard["input_ids"].shape[1]), layers=c.num_hidden_layers,
               heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
               head_dim=c.hidden_size // c.num_attention_heads, sp=sp.size)
    return out


def ep_step(stage: int, use_config: bool = True, micro: int = 2) -> dict:
    """One step at EP 2 (a Mixtral of 4 experts, top 2, hidden 32, 2 layers) on this rank's batch;
    ``use_config`` False: the script splits the experts itself (``apply_expert_parallel``) first."""
    world = dist.get_world_size()
    model = moe_cases.build("mixtral")
    cfg = moe_cases.ds_config(stage, 0.1, micro, world, None)
    if use_config:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}
    else:
        apply_expert_parallel(model, 2, preset="mixtral")
    cfg["comms_logger"] = {"enabled": True}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    ids = moe_cases.batches(1, world, micro, seed=5)[0, engine.dp_rank]

    def run() -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    c = model.config
    out = _one_step(engine, run)
    out.update(tokens=int(ids.numel()), top_k=c.num_experts_per_tok, hidden=c.hidden_size,
               experts=c.num_local_experts, layers=c.num_hidden_layers, ep=2)
    return out
