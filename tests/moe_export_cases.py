"""Expert-parallel exports and zero.Init models, run on every rank of a pool (see test_moe_export.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import moe_cases
import torch
import torch.distributed as dist
from moe_cases import batches, build, ds_config, full_weights

import shardwise
from shardwise.moe import apply_expert_parallel


def state_dict_under_ep(stage: int, out: str) -> dict:
    """Mixtral, EP 2 at ZeRO ``stage``: ``state_dict()`` (at stage 3 inside GatheredParameters) before
    training equals the unsplit model's tensors, after one step the engine's full weights;
    ``save_pretrained`` on every rank writes the full model; a full state dict loads back; a deep
    copy exports the full experts too; and (stage 2) a ``state_dict()`` on rank 1 alone fails in one
    line instead of hanging."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {**ds_config(stage, 0.5, 2, world, 1.0), "expert_parallel": {"enabled": True, "autoep_size": 2}}
    engine, *_ = shardwise.initialize(model=build("mixtral"), config=cfg)
    model = engine.module
    gather = shardwise.zero.GatheredParameters(list(model.parameters())) if stage == 3 else _Nothing()
    with gather:
        before = model.state_dict()
    plain = build("mixtral").state_dict()
    res = {"before_equal": before.keys() == plain.keys() and all(torch.equal(before[k], plain[k]) for k in plain)}
    ids = batches(1, world, 2)[0, engine.dp_rank]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    live = full_weights(engine)
    with gather:
        after = {k: v.clone() for k, v in model.state_dict().items()}
        model.save_pretrained(Path(out), is_main_process=rank == 0)
    res["after_equal"] = all(torch.equal(after[k], live[k]) for k in live)
    res["expert_shape"] = list(after["model.layers.0.mlp.experts.gate_up_proj"].shape)
    if stage < 3:  # a full state dict loads back: each rank keeps its own experts
        model.load_state_dict(after)
        res["reloaded_equal"] = all(torch.equal(a, b) for a, b in zip(full_weights(engine).values(), live.values(),
                                                                      strict=True))
    res["live"] = live if rank == 0 else None
    res["copy_equal"] = _deep_copy_equal(plain)
    if stage == 2:  # once per session: its gloo group is left waiting for rank 0
        res["alone"] = _alone(rank)
    return res


def _deep_copy_equal(plain: dict) -> bool:
    """A deep copy of a split model (TRL's reference model) still exports the full experts."""
    model = build("mixtral")
    apply_expert_parallel(model, 2)
    sd = copy.deepcopy(model).state_dict()
    return sd.keys() == plain.keys() and all(torch.equal(sd[k], plain[k]) for k in plain)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _alone(rank: int) -> str:
    """state_dict() on rank 1 only, with a 3 s join timeout (its own gloo group, used once)."""
    model = build("mixtral")
    apply_expert_parallel(model, 2, join_timeout_s=3.0)
    if rank == 0:
        return "rank 0 did not call it"
    try:
        model.state_dict()
    except RuntimeError as e:
        return str(e)
    return "no error"


def zero_init_train(folder: str) -> dict:
    """Mixtral built by ``from_pretrained`` inside ``shardwise.zero.Init`` (every parameter on meta),
    EP 2 at ZeRO-3 from the config: each rank reads its experts' rows of the folder, the engine
    materializes the rest; trained as ``moe_cases.train_ep`` trains the model built whole."""
    from transformers import AutoModelForCausalLM

    if dist.get_rank() == 0:
        ref = build("mixtral")  # the weights the reference trains, in the 3-D layout the model holds
        ref.config.save_pretrained(folder)
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(Path(folder) / "model.safetensors"))
    dist.barrier()
    with shardwise.zero.Init():
        model = AutoModelForCausalLM.from_pretrained(folder)
    deferred = all(p.is_meta for p in model.parameters())
    model.config._attn_implementation = "eager"
    model.train()
    res = moe_cases.train_ep("mixtral", 3, 2, clip=1.0, use_config=True, model=model)
    return {**res, "was_deferred": deferred}


def zero_init_from_config() -> dict:
    """``from_config`` inside ``shardwise.zero.Init``: the experts come from the model's own init
    (rank 0's values, each rank its slice); one step at ZeRO-3 under EP 2."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with shardwise.zero.Init():
        model = AutoModelForCausalLM.from_config(moe_cases.moe_config("mixtral"))
    deferred = all(p.is_meta for p in model.parameters())
    cfg = {**ds_config(3, 0.5, 2, dist.get_world_size(), 1.0), "expert_parallel": {"enabled": True, "autoep_size": 2}}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    ids = batches(1, dist.get_world_size(), 2)[0, engine.dp_rank]
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    experts = full_weights(engine)["model.layers.0.mlp.experts.gate_up_proj"]
    return {"was_deferred": deferred, "loss": float(loss), "std": float(experts.std()),
            "halves_differ": not torch.equal(experts[:2], experts[2:]), "shape": list(experts.shape),
            "init_range": model.config.initializer_range}


def deep_copy_trains(stage: int) -> dict:
    """A deep copy of a split model (a copied Parameter loses its own groups) handed to the engine
    with the config's ``expert_parallel`` section trains as the split model does."""
    model = build("mixtral")
    apply_expert_parallel(model, 2, preset="mixtral")
    return moe_cases.train_ep("mixtral", stage, 2, clip=1.0, use_config=True, model=copy.deepcopy(model))
