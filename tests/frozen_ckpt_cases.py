"""Rank-side runs for test_checkpoint_frozen.py: models with frozen parameters (frozen layers, LoRA)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from ckpt_cases import STEPS, _result, _train, config
from tiny_models import build
from torch import nn

import shardwise
from shardwise.zero import GatheredParameters

FROZEN_LAYERS = ("embed_tokens", "layers.0.", "norm.weight")  # frozen by substring; the rest trains


class LoraLinear(nn.Module):
    """A frozen base ``nn.Linear`` plus a trainable rank-r update ``B @ A`` (PEFT's LoRA, by hand)."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.randn(base.out_features, r) * 0.01)  # nonzero: both factors train
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t() * self.scale


def make_model(kind: str, seed: int = 0, extra_frozen: bool = False) -> nn.Module:
    """``layers``: a tiny Llama with some layers frozen; ``lora``: every base weight frozen, LoRA
    adapters on q_proj / v_proj trained. ``extra_frozen``: one more frozen parameter (no checkpoint has it)."""
    model = build("llama", seed=seed)
    if kind == "layers":
        for n, p in model.named_parameters():
            p.requires_grad_(not any(s in n for s in FROZEN_LAYERS))
    elif kind == "lora":
        model.requires_grad_(False)
        for layer in model.model.layers:
            att = layer.self_attn
            att.q_proj, att.v_proj = LoraLinear(att.q_proj), LoraLinear(att.v_proj)
    else:
        raise ValueError(kind)
    if extra_frozen:
        model.register_parameter("extra_frozen", nn.Parameter(torch.ones(3), requires_grad=False))
    return model


def frozen_param_names(kind: str) -> list[str]:
    return [n for n, p in make_model(kind).named_parameters() if not p.requires_grad]


def _weights(engine) -> dict[str, torch.Tensor]:
    """Full parameter values (stage 3: gathered for a moment), on every rank."""
    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _engine(kind: str, stage: int, seed: int, extra_frozen: bool = False, **cfg_kw):
    engine, *_ = shardwise.initialize(model=make_model(kind, seed, extra_frozen),
                                      config=config(stage, dist.get_world_size(), **cfg_kw))
    return engine


def save_run(kind: str, stage: int, ckpt: str, exclude: bool = False, hf16: str | None = None, **cfg_kw) -> dict:
    """The uninterrupted run: STEPS steps, checkpoint (and optionally HF export) halfway."""
    engine = _engine(kind, stage, 0, **cfg_kw)
    losses = _train(engine, 0, STEPS // 2)
    engine.save_checkpoint(ckpt, exclude_frozen_parameters=exclude)
    at_save = _weights(engine)
    if hf16 is not None:
        engine.save_16bit_model(hf16)
    losses += _train(engine, STEPS // 2, STEPS)
    return _result(engine, losses, {"at_save": at_save if dist.get_rank() == 0 else None})


def load_run(kind: str, stage: int, ckpt: str, train: bool = True, extra_frozen: bool = False,
             **cfg_kw) -> dict:
    """A fresh engine (another seed, so every loaded value shows) resumes from ``ckpt``."""
    engine = _engine(kind, stage, 123, extra_frozen, **cfg_kw)
    fresh = _weights(engine)
    engine.load_checkpoint(ckpt)
    loaded = _weights(engine)
    losses = _train(engine, engine.global_steps, STEPS) if train else []
    return _result(engine, losses, {"fresh": fresh if dist.get_rank() == 0 else None,
                                    "loaded": loaded if dist.get_rank() == 0 else None})


def load_error(kind: str, stage: int, ckpt: str, extra_frozen: bool = False, **load_kw) -> str:
    engine = _engine(kind, stage, 123, extra_frozen)
    try:
        engine.load_checkpoint(ckpt, **load_kw)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def functional_api(ckpt: str) -> dict:
    """``shardwise.shard`` at stage 3 with LoRA: save with and without frozen parameters, load both."""
    out = {}
    for exclude in (False, True):
        model = shardwise.shard(make_model("lora", 0), stage=3, bucket_size=20_000)
        opt = shardwise.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
        ids = torch.arange(16).view(1, 16) + dist.get_rank()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        shardwise.save_checkpoint(f"{ckpt}/{exclude}", model, opt, exclude_frozen_parameters=exclude)
        with GatheredParameters(list(model.parameters())):
            want = {n: p.detach().clone() for n, p in model.named_parameters()}
        fresh = shardwise.shard(make_model("lora", 123), stage=3, bucket_size=20_000)
        with GatheredParameters(list(fresh.parameters())):
            before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
        shardwise.load_checkpoint(f"{ckpt}/{exclude}", fresh)
        with GatheredParameters(list(fresh.parameters())):
            got = {n: p.detach().clone() for n, p in fresh.named_parameters()}
        frozen = set(frozen_param_names("lora"))
        out[exclude] = all(torch.equal(got[n], before[n] if exclude and n in frozen else want[n]) for n in want)
    return out
