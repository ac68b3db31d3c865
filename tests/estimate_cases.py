"""Rank-side runs for test_estimate_vs_measured.py: a real engine's memory next to the estimate."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tiny_models import VOCAB, batches, build
from transformers import AutoModelForCausalLM, GPT2Config
from zero_cases import make_config

import shardwise
from shardwise.estimate import estimate
from shardwise.estimate.states import master_is_the_store

MODEL_STATES = ("params", "grads", "master_params", "optimizer_states")  # memory_report() keys


def report_key(component: str) -> str:
    """The memory_report() key that counts an estimator component ("fp32 master params" -> ...)."""
    if "master" in component:
        return "master_params"
    if component.startswith("Adam"):
        return "optimizer_states"
    return "grads" if component.endswith("grads") else "params"


def odd_gpt2_config() -> GPT2Config:
    """GPT-2 with odd width: most tensors (and Ψ) are not divisible by 2 or 4, so shards are padded."""
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=33, n_layer=2, n_head=3, n_positions=63, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg.attn_implementation = "eager"
    return cfg


def build_model(kind: str) -> torch.nn.Module:
    if kind == "gpt2_odd":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(odd_gpt2_config())
        model.train()
        return model
    return build(kind)


def expected_components(psi: int, world: int, precision: str, stage: int) -> dict[str, int]:
    """The estimator's per-rank bytes for each memory_report() key (a shard is ceil(Ψ/N))."""
    est = estimate(psi, world, dtype=precision)
    shard = -(-psi // world)
    out = dict.fromkeys(MODEL_STATES, 0)
    for c in est.components:
        per_param = c.bytes // est.psi
        out[report_key(c.name)] += per_param * (shard if stage >= c.sharded_from_stage else psi)
    if master_is_the_store(precision, stage, "none", "fp32"):  # the fp32 master is the parameters' copy
        out["params"] -= 2 * shard
    return out


def measure(kind: str, stages: list[int], precision: str, steps: int = 1, seq: int = 8) -> list[dict]:
    """For each stage: train ``steps`` steps, then memory_report() next to the estimate for Ψ and N."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for stage in stages:
        extra = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
        config = make_config(stage, precision=precision, micro=1, dp=world, **extra)
        model = build_model(kind)
        psi = sum(p.numel() for p in model.parameters())  # exact Ψ; a tied weight counts once
        engine, *_ = shardwise.initialize(model=model, config=config)
        data = batches(steps, 1, world, seq)
        for s in range(steps):
            ids = data[s, 0, rank:rank + 1]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            grads = engine.memory_report()["grads"]  # as backward leaves them: stage 3 lets go at the step
            engine.step()
        rep = {**engine.memory_report(), "grads": grads}
        est = estimate(psi, world, dtype=precision).stages[stage]
        groups = list(engine.groups) + [g for gs in engine.unit_groups for g in gs if not g.trainable]
        padding = sum(g.padded_numel - g.numel for g in groups)
        results.append({
            "kind": kind, "stage": stage, "precision": precision, "psi": psi, "world": world,
            "report": {k: rep[k] for k in MODEL_STATES}, "measured": sum(rep[k] for k in MODEL_STATES),
            # shardwise's own figure (the paper's, less a 16-bit shard beside an fp32 master at stage 3)
            "estimated": est.resident_bytes, "formula": est.resident_formula, "paper": est.per_device_bytes,
            # the same formula with Ψ counted as the engine lays it out (each group padded to N)
            "estimated_padded": estimate(psi + padding, world, dtype=precision).stages[stage].resident_bytes,
            "expected": expected_components(psi, world, precision, stage),
            "groups": len(groups), "padding_elements": padding,
            "steps": engine.global_steps,
        })
        del engine, model
    return results
