"""zero.Init ``from_pretrained`` of MoE folders in the hub's per-expert layout, on every rank of a pool
(see test_moe_hub_layout.py)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from moe_cases import batches, build, ds_config, full_weights

import shardwise


def save_hub_folder(kind: str, folder: str) -> None:
    """``save_pretrained`` of the tiny ``kind`` model (rank 0), seen by every rank after a barrier."""
    if dist.get_rank() == 0:
        build(kind).save_pretrained(folder)
    dist.barrier()


def zero_init_hub(kind: str, folder: str, ep: int, facade: bool = False) -> dict:
    """``from_pretrained`` of a ``save_pretrained`` folder inside zero.Init, ZeRO-3 (EP ``ep`` when
    > 1): the gathered parameters against plain ``from_pretrained`` of the same folder, bit for bit,
    then one training step runs."""
    from transformers import AutoModelForCausalLM

    save_hub_folder(kind, folder)
    plain = dict(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).named_parameters())
    init = shardwise.zero.Init
    if facade:
        shardwise.install_as_deepspeed()
        import deepspeed

        init = deepspeed.zero.Init
    with init():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    deferred = all(p.is_meta for p in model.parameters())
    model.config._attn_implementation = "eager"
    cfg = ds_config(3, 0.5, 2, dist.get_world_size(), 1.0)
    if ep > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    got = full_weights(engine)
    unequal = sorted(n for n in plain if n not in got or not torch.equal(got[n], plain[n].detach()))
    ids = batches(1, dist.get_world_size(), 2)[0, engine.dp_rank]
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return {"was_deferred": deferred, "names_equal": got.keys() == plain.keys(), "unequal": unequal,
            "loss": float(loss.detach()), "experts": list(got["model.layers.0.mlp.experts.gate_up_proj"].shape)}


def missing_tensor(folder: str) -> str:
    """A hub-layout Mixtral folder with one expert's ``w3`` removed: zero.Init's read is refused."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    if dist.get_rank() == 0:
        build("mixtral").save_pretrained(folder)
        path = Path(folder) / "model.safetensors"
        tensors = load_file(str(path))
        del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
        save_file(tensors, str(path), metadata={"format": "pt"})
    dist.barrier()
    with shardwise.zero.Init():
        model = AutoModelForCausalLM.from_pretrained(folder)
    try:
        shardwise.initialize(model=model, config=ds_config(3, 0.5, 2, dist.get_world_size(), None))
    except Exception as e:  # noqa: BLE001 - the test checks its type and text
        return f"{type(e).__name__}: {e}"
    return "no error"
