"""Rank-side stage-3 checks (used by test_stage3.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tiny_models import batches, build
from zero_cases import make_config

import shardwise
from shardwise.zero import GatheredParameters

GEN = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


def prompt() -> torch.Tensor:
    return batches(1, 1, 2, 5, seed=7)[0, 0]


def generate_stage3(kind: str, gather_whole_model: bool) -> list:
    engine, *_ = shardwise.initialize(model=build(kind), config=make_config(3))
    engine.eval()
    out = engine.generate(prompt(), gather_whole_model=gather_whole_model, **GEN)
    return out.tolist()


def reference_generate(kind: str) -> list:
    model = build(kind).eval()
    with torch.no_grad():
        return model.generate(prompt(), **GEN).tolist()


def placeholders_and_guard() -> dict:
    """Outside forward: full shapes, NaN (never size-0) values, and a clear state_dict error."""
    model = build("llama")
    engine, *_ = shardwise.initialize(model=model, config=make_config(3, stage3_param_persistence_threshold=0))
    w = model.model.layers[0].mlp.up_proj.weight
    out = {"shape": tuple(w.shape), "all_nan": bool(torch.isnan(w).all())}
    try:
        model.state_dict()
        out["state_dict_error"] = None
    except RuntimeError as e:
        out["state_dict_error"] = str(e)
    with GatheredParameters(model.parameters()):
        sd = model.state_dict()
        out["gathered_ok"] = all(torch.isfinite(t).all() for t in sd.values())
    return out


def modifier_rank_broadcast() -> dict:
    model = build("llama")
    engine, *_ = shardwise.initialize(model=model, config=make_config(3))
    w = model.model.layers[1].self_attn.q_proj.weight
    with GatheredParameters([w], modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                w.fill_(0.125)
    with GatheredParameters([w]):
        seen = float(w.mean())
    # the edit reached the master too: one SGD-free check is that a forward still works
    ids = prompt()
    loss = engine(input_ids=ids, labels=ids).loss
    return {"seen": seen, "loss_finite": bool(torch.isfinite(loss))}


def frozen_embeddings(stage: int) -> dict:
    model = build("llama")
    model.model.embed_tokens.weight.requires_grad_(False)
    engine, *_ = shardwise.initialize(model=model, config=make_config(stage))
    data = batches(2, 1, 4, 16)
    rank = dist.get_rank()
    losses = []
    for s in range(2):
        ids = data[s, 0, rank * 2:(rank + 1) * 2]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    state_numel = sum(v.numel() for st in engine.optimizer.state.values() for v in st.values()
                      if torch.is_tensor(v) and v.numel() > 1)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with GatheredParameters(model.parameters()):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "state_numel": state_numel, "trainable": trainable,
            "weights": weights if rank == 0 else None}


def reference_frozen() -> dict:
    model = build("llama")
    model.model.embed_tokens.weight.requires_grad_(False)
    from zero_cases import BETAS, EPS, LR, WD
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=BETAS,
                            eps=EPS, weight_decay=WD)
    data = batches(2, 1, 4, 16)
    losses = {0: [], 1: []}
    for s in range(2):
        opt.zero_grad()
        for r in range(2):
            ids = data[s, 0, r * 2:(r + 1) * 2]
            loss = model(input_ids=ids, labels=ids).loss
            (loss / 2).backward()
            losses[r].append(float(loss.detach()))
        opt.step()
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def build_under_init_peak(layers: int, hidden: int, mmap_threshold: int | None = None) -> dict:
    """Peak RSS growth while building and sharding a from_config model under zero.Init.

    ``mmap_threshold``: glibc's mmap threshold, set first with ``mallopt`` (what the environment
    variable ``MALLOC_MMAP_THRESHOLD_`` sets when a process starts; a forked rank has started)."""
    import ctypes
    import gc
    import resource

    if mmap_threshold is not None:
        assert ctypes.CDLL("libc.so.6").mallopt(-3, mmap_threshold) == 1  # -3: M_MMAP_THRESHOLD

    from transformers import AutoModelForCausalLM, LlamaConfig

    def cfg(n_layers: int, h: int) -> LlamaConfig:
        return LlamaConfig(vocab_size=1024, hidden_size=h, intermediate_size=h * 2, num_hidden_layers=n_layers,
                           num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)

    AutoModelForCausalLM.from_config(cfg(1, 64))  # import and warm up everything outside the window
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with shardwise.zero.Init():
        model = AutoModelForCausalLM.from_config(cfg(layers, hidden))
    engine, *_ = shardwise.initialize(model=model, config=make_config(3, stage3_param_persistence_threshold=0))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    numel = sum(g.numel for gs in engine.unit_groups for g in gs)
    layer0 = model.model.layers[0]
    with GatheredParameters(list(layer0.parameters())):
        std = float(layer0.mlp.up_proj.weight.std())
        norm_ok = bool((layer0.input_layernorm.weight == 1).all())
        layer_bytes = 4 * sum(p.numel() for p in layer0.parameters())
    ids = prompt()
    loss = float(engine(input_ids=ids, labels=ids).loss)
    return {"peak": peak, "model_bytes": 4 * numel, "layer_bytes": layer_bytes, "std": std,
            "norm_ok": norm_ok, "loss": loss}


class Branchy(torch.nn.Module):
    """Three units; ``skip`` leaves the middle one out, so the forward order changes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.c = (torch.nn.Linear(12, 12) for _ in range(3))

    def forward(self, x, skip: bool):
        h = torch.tanh(self.a(x))
        if not skip:
            h = torch.tanh(self.b(h))
        return self.c(h)


def branchy_train(world: int | None = None) -> dict:
    """Paths A, B, A, B...: stage 3 (re-recording its order) against one-process AdamW."""
    import logging

    from zero_cases import BETAS, EPS, LR, WD

    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(5))
    skips = [False, True, False, True, True, False]
    if world is None:  # the reference
        model = Branchy()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        for skip in skips:
            # zeros, not None: a flat sharded optimizer steps an unused parameter with a zero
            # gradient (momentum and weight decay go on), as DeepSpeed does
            opt.zero_grad(set_to_none=False)
            loss = model(x, skip).square().mean()
            loss.backward()
            opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    model = Branchy()
    cfg = make_config(3, micro=4, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=1000)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("shardwise").addHandler(handler)
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    rank = dist.get_rank()
    for skip in skips:
        loss = engine(x[rank * 4:(rank + 1) * 4], skip).square().mean()
        engine.backward(loss)
        engine.step()
    logging.getLogger("shardwise").removeHandler(handler)
    with GatheredParameters(model.parameters()):
        w = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"weights": w, "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING]}


def checkpointed_train(kind: str, config: dict, steps: int = 3) -> dict:
    """HF gradient checkpointing under the engine (recompute runs inside backward)."""
    import tiny_models
    from zero_cases import train_ranks

    orig = tiny_models.build

    mlp_calls = [0]

    def build_ckpt(k: str, seed: int = 0, vocab: int = tiny_models.VOCAB):
        m = orig(k, seed, vocab)
        # reentrant: torch 2.13's non-reentrant checkpoint did not recompute these tiny layers
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        for layer in m.model.layers:  # inner hooks run in the recompute too: count forwards
            layer.mlp.register_forward_hook(lambda *_: mlp_calls.__setitem__(0, mlp_calls[0] + 1))
        return m

    import zero_cases

    zero_cases.build = build_ckpt
    try:
        out = train_ranks(kind, config, steps=steps)
    finally:
        zero_cases.build = orig
    out["mlp_calls"] = mlp_calls[0]
    return out


def _live_bytes(baseline: set[int]) -> int:
    """Bytes of every tensor storage Python reaches that is not in ``baseline``, each counted once."""
    import gc

    gc.collect()
    seen: dict[int, int] = {}
    for ptr, nbytes in _real_storages():
        if nbytes and ptr not in baseline:
            seen[ptr] = max(seen.get(ptr, 0), nbytes)
    return sum(seen.values())


def _real_storages() -> list[tuple[int, int]]:
    """(data pointer, bytes) of every tensor storage Python reaches that holds memory.

    Meta tensors and tensors without data (a ``FakeTensor`` an earlier case's ``torch.compile`` left
    in this pool worker's caches) have no data pointer and hold no memory: they are skipped.
    """
    import gc

    from torch._subclasses.fake_tensor import is_fake

    out = []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta" and not is_fake(obj):
            try:
                st = obj.untyped_storage()
                out.append((st.data_ptr(), st.nbytes()))
            except (RuntimeError, NotImplementedError):
                continue
    return out


def after_backward_state(precision: str) -> list[dict]:
    """After each backward (stage 3, persistence 0, overlapped reductions): what is gathered, held or live."""
    import gc

    gc.collect()
    baseline = {ptr for ptr, _ in _real_storages()}
    model = build("llama")
    cfg = make_config(3, precision=precision, overlap=True, stage3_param_persistence_threshold=0)
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    data = batches(2, 1, 4, 16)
    rank, out = dist.get_rank(), []
    for s in range(2):
        ids = data[s, 0, rank * 2:(rank + 1) * 2]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        groups = [g for gs in engine.unit_groups for g in gs]
        rep = engine.memory_report()
        out.append({
            "gathered": [g.names[0] for g in groups if g.is_gathered or g.flat_param.untyped_storage().nbytes()],
            "buckets": sum(g.flat_grad is not None or bool(g._buckets_in_flight) for g in groups),
            "pending": sum(bool(g._pending) for g in groups),
            "in_use": groups[0].inflight.in_use, "comm_buffers": int(rep["comm_buffers"]),
            "params": int(rep["params"]), "master_params": int(rep["master_params"]),
            "shard_bytes": sum(g.shard_numel * g.flat_param.element_size() for g in groups),
            "report_total": int(rep["total"]), "live": _live_bytes(baseline), "batch_bytes": ids.nbytes})
        engine.step()
    return out
