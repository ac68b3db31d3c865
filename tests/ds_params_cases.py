"""Rank-side cases of tests/test_ds_params.py: DeepSpeed's live ZeRO-3 parameter surface on an
engine built by the facade's ``deepspeed.initialize`` (shardwise/deepspeed/params.py)."""

from __future__ import annotations

import torch
from tiny_models import build

import shardwise
from shardwise.deepspeed.params import ZeroParamStatus
from shardwise.deepspeed.stage3 import initialize
from shardwise.zero import GatheredParameters

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "gradient_clipping": 0.0,  # the plain reference does not clip (DeepSpeed's own default is 1.0)
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _engine():
    model = build("llama")
    engine, *_ = initialize(model=model, config=CONFIG, model_parameters=model.parameters())
    return engine


def status_follows_the_live_state() -> dict:
    """ds_status / ds_active_sub_modules read inside and outside a layer's forward."""
    engine = _engine()
    layer = engine.module.model.layers[0]
    q = layer.self_attn.q_proj.weight
    seen = {}

    def look(module, _args):
        seen["in_forward"] = q.ds_status.name
        seen["active_has_layer"] = id(layer) in q.ds_active_sub_modules

    handle = layer.register_forward_pre_hook(look)
    ids = torch.arange(8).view(1, 8)
    engine(input_ids=ids)
    handle.remove()
    seen["after"] = q.ds_status.name
    seen["active_after"] = len(q.ds_active_sub_modules)
    with GatheredParameters([q]):
        seen["gathered"] = q.ds_status.name
    seen["is_parameter"] = isinstance(q, torch.nn.Parameter)
    seen["external_root"] = [type(p).__name__ for _, p in engine.module.ds_external_parameters()]
    other = engine.module.model.layers[1]
    shardwise.zero.register_external_parameter(other, q)
    seen["external_registered"] = [p is q for _, p in other.ds_external_parameters()]
    seen["enum_is_served"] = ZeroParamStatus.AVAILABLE.name
    return seen


def trl_generation_hooks() -> dict:
    """trl.models.utils' remove_hooks / add_hooks around generate() inside GatheredParameters, as
    unwrap_model_for_generation drives them: greedy tokens equal the plain model's, generation
    moves no gather, and training after it equals training without it."""
    from trl.models.utils import add_hooks, remove_hooks

    engine = _engine()
    prompt = torch.arange(5).view(1, 5) + 3
    before = engine.comm_stats().get("all_gather", 0)
    with GatheredParameters(engine.module.parameters()):
        gathered_bytes = engine.comm_stats().get("all_gather", 0) - before
        remove_hooks(engine)
        mid = engine.comm_stats().get("all_gather", 0)
        out = engine.module.generate(prompt, max_new_tokens=6, do_sample=False)
        gen_bytes = engine.comm_stats().get("all_gather", 0) - mid
        add_hooks(engine)
    after_status = engine.module.model.layers[0].mlp.up_proj.weight.ds_status.name
    losses = []
    for step in range(3):
        ids = (torch.arange(8).view(1, 8) * (step + 2) + torch.distributed.get_rank()) % 500
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"tokens": out.tolist(), "gathered": gathered_bytes, "gen_bytes": gen_bytes, "after": after_status,
            "losses": losses}


def hooks_left_removed_is_refused() -> str:
    """An exception between TRL's remove_hooks and add_hooks leaves the hooks inert while the
    GatheredParameters block releases the model: the next forward refuses instead of computing
    with placeholders."""
    from trl.models.utils import remove_hooks

    engine = _engine()
    try:
        with GatheredParameters(engine.module.parameters()):
            remove_hooks(engine)
            raise KeyError("generation failed")
    except KeyError:
        pass
    try:
        engine(input_ids=torch.arange(8).view(1, 8))
    except RuntimeError as err:
        return str(err)
    return "no error"


def plain_reference() -> dict:
    """The same model in one process: greedy tokens, and three AdamW steps on the global batch."""
    model = build("llama")
    out = model.generate(torch.arange(5).view(1, 5) + 3, max_new_tokens=6, do_sample=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        ids = torch.stack([(torch.arange(8) * (step + 2) + r) % 500 for r in range(2)])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"tokens": out.tolist(), "losses": losses}
