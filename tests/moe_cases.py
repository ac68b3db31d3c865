"""Expert-parallel cases run on every rank of a pool (see test_moe.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import shardwise
from shardwise.moe import apply_expert_parallel, combine, dispatch, get_expert_mesh

VOCAB = 97
SEQ = 8
SP_AUX = 0.1  # router_aux_loss_coef of the SP x EP case: large enough that the mean of the shards' aux losses fails it


def moe_config(kind: str, experts: int = 4, aux: float = 0.02, attn: str = "eager"):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False, output_router_logits=aux > 0, router_aux_loss_coef=aux,
                  num_experts_per_tok=2)
    if kind == "mixtral":
        cfg = AutoConfig.for_model("mixtral", num_local_experts=experts, router_jitter_noise=0.0, **common)
    elif kind == "qwen3_moe":
        cfg = AutoConfig.for_model("qwen3_moe", num_experts=experts, moe_intermediate_size=24, norm_topk_prob=True,
                                   decoder_sparse_step=1, mlp_only_layers=[], **common)
    elif kind == "gpt_oss":  # transposed experts with biases, clamped SwiGLU; sliding-window layers, sinks
        common.pop("intermediate_size")
        cfg = AutoConfig.for_model("gpt_oss", num_local_experts=experts, intermediate_size=24, head_dim=8,
                                   sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                   swiglu_limit=0.5, rope_parameters=dict(rope_type="yarn", factor=2.0, beta_fast=32.0,
                                   beta_slow=1.0, truncate=False, original_max_position_embeddings=32), **common)
    else:  # other families: forward checks only
        extra = {"qwen2_moe": dict(num_experts=experts, moe_intermediate_size=24, shared_expert_intermediate_size=24),
                 "olmoe": dict(num_experts=experts),
                 "deepseek_v3": dict(n_routed_experts=experts, moe_intermediate_size=24, first_k_dense_replace=0,
                                     n_group=1, topk_group=1, q_lora_rank=None),
                 "deepseek_v2": dict(n_routed_experts=experts, moe_intermediate_size=24, first_k_dense_replace=0,
                                     n_group=1, topk_group=1, q_lora_rank=None)}[kind]
        common.pop("output_router_logits"), common.pop("router_aux_loss_coef")
        if kind.startswith("deepseek"):
            common["num_key_value_heads"] = 4  # multi-head latent attention: one kv head per head
        cfg = AutoConfig.for_model(kind, **extra, **common)
    cfg._attn_implementation = attn
    return cfg


def build(kind: str, seed: int = 0, experts: int = 4, aux: float = 0.02, attn: str = "eager") -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(kind, experts, aux, attn))
    with torch.no_grad():  # routers start at zero in some families: give every router a spread
        for n, p in model.named_parameters():
            if n.endswith("gate.weight") and p.abs().sum() == 0:
                p.normal_(0, 0.5)
            if n.endswith("_proj_bias"):  # GPT-OSS's expert biases start at zero: make each expert's its own,
                p.normal_(0, 0.5)  # large enough that the SwiGLU's clamps (limit 0.5) act on some units
    model.train()
    return model


def batches(steps: int, world: int, micro: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, world, micro, SEQ), generator=g)


# -- dispatch / combine ---------------------------------------------------------------
def roundtrip(num_experts: int, tokens: int | list[int], top_k: int, only_expert: int | None = None) -> dict:
    """Megatron's dispatcher check with identity experts: top-1 with unit weights, combine(dispatch(x))
    is x bit for bit and x's gradient is the upstream gradient; top-k with random weights, both equal
    the same weighted sum computed locally (nothing moved)."""
    rank = dist.get_rank()
    mesh = get_expert_mesh(dist.get_world_size())
    tokens = tokens[rank] if isinstance(tokens, list) else tokens
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(tokens, 16, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]
                      or [torch.zeros(0, top_k, dtype=torch.long)]).reshape(tokens, top_k)
    if only_expert is not None:
        idx = torch.full((tokens, 1), only_expert, dtype=torch.long)
        top_k = 1
    w = torch.rand(tokens, top_k, generator=g) if top_k > 1 else torch.ones(tokens, 1)  # top-1: unit weights
    rows, routed = dispatch(x, idx, num_experts, mesh.ep)
    local = num_experts // mesh.ep.size
    per_rank = torch.bincount(idx.reshape(-1) // local, minlength=mesh.ep.size)
    dist.all_reduce(per_rank)  # rows arriving at rank j = pairs any rank routed to j's experts
    out = combine(rows, w, routed, mesh.ep)
    up = torch.randn(tokens, 16, generator=g)
    (out * up).sum().backward()
    x2 = x.detach().clone().requires_grad_()  # the same weighted sum computed without moving anything
    want = (x2.unsqueeze(1).expand(-1, top_k, -1) * w.unsqueeze(-1)).sum(1)
    (want * up).sum().backward()
    return {"rows": rows.shape[0], "expected_rows": int(per_rank[rank]), "counts": routed.counts,
            "equal": torch.equal(out, want) and (top_k > 1 or torch.equal(out, x.detach())),
            "max_err": float((out - x).detach().abs().max()) if tokens else 0.0,
            # top-k: x's k gradient terms are summed in another order (sorted pairs): a few ulps
            "grad_equal": (torch.allclose(x.grad, x2.grad, rtol=4e-7, atol=1e-7)
                           and (top_k > 1 or torch.equal(x.grad, up)))}


def sorted_rows(num_experts: int) -> dict:
    """Rows arrive grouped by local expert: with top-1 routing and each row holding its expert id,
    block e of what arrives is all ``first + e``."""
    rank = dist.get_rank()
    mesh = get_expert_mesh(dist.get_world_size())
    g = torch.Generator().manual_seed(20 + rank)
    idx = torch.randint(0, num_experts, (11, 1), generator=g)
    rows, routed = dispatch(idx.float(), idx, num_experts, mesh.ep)
    local = num_experts // mesh.ep.size
    ok = all(bool((block == rank * local + e).all()) for e, block in enumerate(rows.split(routed.counts)))
    return {"grouped": ok, "counts": routed.counts}


# -- training -------------------------------------------------------------------------
def ds_config(stage: int, lr: float, micro: int, world: int, clip: float | None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "train_batch_size": micro * world,
           "optimizer": {"type": "SGD", "params": {"lr": lr}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": 4000, "allgather_bucket_size": 4000}}
    if clip is not None:
        cfg["gradient_clipping"] = clip
    return cfg


def train_ep(kind: str, stage: int, ep: int, steps: int = 3, lr: float = 0.5, micro: int = 2,
             clip: float | None = None, force: bool = False, use_config: bool = False, gas: int = 1,
             facade: bool = False, bf16: bool = False, model: torch.nn.Module | None = None,
             fp16: bool = False) -> dict:
    """Train under EP ``ep`` at ZeRO ``stage`` on this rank's part of the global batch (``gas``
    micro-batches of ``micro // gas`` sequences); return the losses (per micro-batch when gas > 1),
    the full weights gathered on every rank, and the expert bytes held here. ``model``: one built
    elsewhere (with ``build(kind)``'s weights) instead of ``build(kind)``."""
    world, _rank = dist.get_world_size(), dist.get_rank()
    model = build(kind) if model is None else model
    if force:
        force_routing(model)
    cfg = ds_config(stage, lr, micro // gas, world, clip)
    cfg.update(gradient_accumulation_steps=gas, train_batch_size=micro * world)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if fp16:  # a static loss scale: every step applied, so the update compares with fp32's step for step
        cfg["fp16"] = {"enabled": True, "loss_scale": 256}
    if use_config:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": kind}
    else:
        apply_expert_parallel(model, ep, preset=kind)
    init = shardwise.initialize
    if facade:  # a DeepSpeed script: `import deepspeed` is shardwise's facade
        shardwise.install_as_deepspeed()
        import deepspeed

        init = deepspeed.initialize
    engine, *_ = init(model=model, config=cfg)
    data = batches(steps, world, micro)
    losses, norms = [], []
    mb = micro // gas
    for s in range(steps):
        part = []
        for m in range(gas):
            ids = data[s, engine.dp_rank, m * mb:(m + 1) * mb]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            part.append(float(loss.detach()))
        losses.append(part[0] if gas == 1 else part)
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "weights": full_weights(engine),
            "expert_bytes": expert_bytes(engine)}


def force_routing(model: torch.nn.Module, experts: tuple[int, ...] = (0, 1)) -> None:
    """Every router picks ``experts`` for every token (their softmax probabilities, renormalized):
    with 4 experts on 2 EP ranks all tokens go to rank 0 and rank 1 receives nothing."""
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.register_forward_hook(lambda mod, args, out, ex=experts: _forced(out, ex))


def _forced(out: tuple, experts: tuple[int, ...]) -> tuple:
    logits, scores, _ = out
    pick = torch.tensor(experts)
    top = torch.softmax(logits.float(), dim=-1)[:, pick]
    top = top / top.sum(-1, keepdim=True)
    return logits, top.to(scores.dtype), pick.expand(logits.shape[0], -1)


def full_weights(engine) -> dict[str, torch.Tensor]:
    """Every parameter whole (experts gathered over the EP group), by name, on every rank."""
    from shardwise.checkpoint import gather_experts

    out = {}
    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
        for n, p in engine.module.named_parameters():
            out[n] = gather_experts(p.detach().clone(), p)
    return out


def expert_bytes(engine) -> dict[str, int]:
    """Bytes of expert parameters this rank holds (groups' persistent params) and of the full experts."""
    held = sum(g.memory()["params"] for g in engine.sharding.all_groups if g.own_groups is not None)
    return {"held": held}


# -- the single-process reference -----------------------------------------------------
def reference(kind: str, world: int, steps: int = 3, lr: float = 0.5, micro: int = 2, clip: float | None = None,
              implementation: str | None = None, expert_lr_factor: float = 1.0, force: bool = False,
              gas: int = 1) -> dict:
    """One process, the same global batch: the loss is the mean over the ranks' parts of each part's
    loss (what data parallelism computes; the aux loss is per part), SGD, optional clipping.
    ``expert_lr_factor`` 2 equals doubled expert gradients (the bug a tolerance must catch)."""
    model = build(kind)
    if force:
        force_routing(model)
    if implementation is not None:
        model.config._experts_implementation = implementation
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    rest = [p for n, p in model.named_parameters() if ".experts." not in n]
    opt = torch.optim.SGD([{"params": rest}, {"params": experts, "lr": lr * expert_lr_factor}], lr=lr)
    data = batches(steps, world, micro)
    losses, norms = [], []
    for s in range(steps):
        mb = micro // gas  # parts: rank-major, then micro-batch
        parts = [model(input_ids=x, labels=x).loss for r in range(world)
                 for x in (data[s, r, m * mb:(m + 1) * mb] for m in range(gas))]
        torch.stack(parts).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append([float(x.detach()) for x in parts])
    return {"losses": losses, "norms": norms,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "expert_numel": sum(p.numel() for p in experts)}



def forward_logits(kind: str, ep: int) -> dict:
    """Logits and loss of one forward under EP vs the same model unsplit (every family)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ids = batches(1, world, 2)[0, rank]
    ref = build(kind)
    want = ref(input_ids=ids, labels=ids)
    model = build(kind)
    apply_expert_parallel(model, ep)
    got = model(input_ids=ids, labels=ids)
    return {"logits_err": float((got.logits - want.logits).abs().max()),
            "logits_scale": float(want.logits.abs().max()), "loss": (float(got.loss), float(want.loss))}


def refused_by_config(kind: str, section: dict, extra: dict | None = None) -> str:
    """initialize() with an ``expert_parallel`` section that must be refused: the one-line message."""
    from tiny_models import build as build_dense

    model = build_dense("llama") if kind == "llama" else build(kind)
    cfg = {**ds_config(2, 0.1, 1, dist.get_world_size(), None), "expert_parallel": section, **(extra or {})}
    try:
        shardwise.initialize(model=model, config=cfg)
    except (ValueError, shardwise.config.ConfigError) as e:
        return str(e)
    return "not refused"


def ckpt_run(kind: str, stage: int, ep: int | None, steps: int, first: int = 0, load_dir: str | None = None,
             save_dir: str | None = None, export_dir: str | None = None) -> dict:
    """Train steps ``first .. first + steps - 1`` (SGD with momentum: per-element optimizer state)
    under EP ``ep`` (None: no EP, experts ZeRO-sharded over every rank), optionally loading a
    checkpoint first and saving one / exporting HF weights after."""
    world = dist.get_world_size()
    cfg = ds_config(stage, 0.2, 2, world, 1.0)
    cfg["optimizer"]["params"]["momentum"] = 0.9
    if ep is not None:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    engine, *_ = shardwise.initialize(model=build(kind), config=cfg)
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    data = batches(first + steps, world, 2)
    losses = []
    for s in range(first, first + steps):
        ids = data[s, engine.dp_rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    if export_dir is not None:
        engine.save_16bit_model(export_dir)
    return {"losses": losses, "weights": full_weights(engine)}


def generate_ep(kind: str, stage: int, ep: int) -> list[list[int]]:
    """Greedy tokens of engine.generate under EP; each rank its own prompt (different lengths of output
    work too: synced_gpus keeps every rank in each forward's all-to-all)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {**ds_config(stage, 0.1, 1, world, None), "expert_parallel": {"enabled": True, "autoep_size": ep}}
    engine, *_ = shardwise.initialize(model=build(kind, aux=0.0), config=cfg)
    engine.eval()
    prompt = batches(1, world, 1, seed=7)[0, rank]
    with torch.no_grad():
        out = engine.generate(input_ids=prompt, max_new_tokens=4 + 3 * rank, do_sample=False, pad_token_id=0)
    return out.tolist()


def generate_reference(kind: str, world: int) -> list[list[list[int]]]:
    model = build(kind, aux=0.0).eval()
    outs = []
    for r in range(world):
        prompt = batches(1, world, 1, seed=7)[0, r]
        with torch.no_grad():
            outs.append(model.generate(input_ids=prompt, max_new_tokens=4 + 3 * r, do_sample=False,
                                       pad_token_id=0).tolist())
    return outs


# -- sequence parallelism x expert parallelism ------------------------------------------------
def train_sp_ep(kind: str, stage: int, sp: int, ep: int, steps: int = 3, lr: float = 0.5, micro: int = 2,
                clip: float | None = None, train_loop: bool = False, aux: float = SP_AUX) -> dict:
    """Ulysses SP ``sp`` and EP ``ep`` on the same ranks (sdpa): each SP group reads one sample set,
    splits it with ``split_batch``; the loss is ``sequence_parallel_loss`` (the whole batch's token
    mean) plus ``router_aux_loss`` (the aux loss over the whole sequence, from the SP ranks' router
    logits gathered). ``train_loop``: the loss ``shardwise train`` computes (``train.loop.micro_loss``)
    instead of the plain-loop recipe."""
    from shardwise.sequence_parallel import router_aux_loss, sequence_parallel_loss, split_batch
    from shardwise.train.loop import micro_loss

    world = dist.get_world_size()
    model = build(kind, attn="sdpa", aux=aux)
    cfg = ds_config(stage, lr, micro, world // sp, clip)
    cfg.update(sequence_parallel_size=sp, expert_parallel={"enabled": True, "autoep_size": ep, "preset_model": kind})
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    sp_group = engine.sequence_parallel
    data = batches(steps, world // sp, micro)
    losses, norms = [], []
    for s in range(steps):
        ids = data[s, engine.dp_rank]
        if train_loop:
            loss = micro_loss(engine, ids)
        else:
            batch = {"input_ids": ids, "labels": ids}
            shard = split_batch(batch, sp_group)
            labels = shard.pop("shift_labels")
            out = engine(**shard)
            loss = sequence_parallel_loss(out.logits, labels, sp_group) + router_aux_loss(out, model, batch, sp_group)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "weights": full_weights(engine),
            "sp_rank": engine.sequence_parallel.rank, "dp_world": engine.dp_world, "dp_rank": engine.dp_rank}


def reference_sp(kind: str, steps: int = 3, lr: float = 0.5, micro: int = 2, clip: float | None = None,
                 implementation: str | None = None, aux: float = SP_AUX, dp: int = 1) -> dict:
    """One process, the whole batch, no SP: the model's own ``outputs.loss`` (labels given: the token-mean
    loss plus ``router_aux_loss_coef`` times its aux loss over the whole batch), SGD, optional clipping.
    ``dp``: the data-parallel replicas' parts of each step (``batches``' layout), the loss the mean of
    the parts' losses (each with its own aux loss, what data parallelism computes); ``parts`` per step."""
    model = build(kind, attn="sdpa", aux=aux)
    if implementation is not None:
        model.config._experts_implementation = implementation
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = batches(steps, dp, micro)
    losses, norms, parts = [], [], []
    for s in range(steps):
        each = [model(input_ids=data[s, r], labels=data[s, r]).loss for r in range(dp)]
        loss = each[0] if dp == 1 else torch.stack(each).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        parts.append([float(x.detach()) for x in each])
    return {"losses": losses, "norms": norms, "parts": parts,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def sp_aux_matches_whole(kind: str, seq: int, pad_from: int | None) -> dict:
    """One forward + backward with SP over every rank (no engine) against the model's own no-SP loss on
    the whole batch, labels and ``attention_mask`` given: ``seq`` not a multiple of the SP degree (the
    tail ``split_batch`` appends) and the last sample right padded from ``pad_from`` (the shards carry no
    mask): the pad tokens must be left out of the aux loss as the no-SP run's mask leaves them out.
    Gradients are summed over the SP ranks and divided by their count, as the engine does. Also the
    mean of the shards' own aux losses (the objective before), to show the bound tells them apart."""
    import copy

    from shardwise.sequence_parallel import (
        SequenceParallel,
        register_attention,
        router_aux_loss,
        sequence_parallel_loss,
        split_batch,
    )

    sp = SequenceParallel.of_size(dist.get_world_size())
    model = build(kind, attn="sdpa", aux=SP_AUX)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    if pad_from is not None:
        batch["attention_mask"][-1, pad_from:] = 0
        batch["labels"][-1, pad_from:] = -100
    ref_model = copy.deepcopy(model)
    ref = ref_model(**batch)
    ref.loss.backward()
    register_attention(model, sp)
    shard = split_batch(batch, sp)
    labels = shard.pop("shift_labels")
    out = model(**shard)
    aux = router_aux_loss(out, model, batch, sp)
    loss = sequence_parallel_loss(out.logits, labels, sp) + aux
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    for t in grads.values():
        dist.all_reduce(t, group=sp.group)
        t /= sp.size
    want = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    assert grads.keys() == want.keys()
    shard_aux = out.aux_loss.detach().clone()
    dist.all_reduce(shard_aux, group=sp.group)
    whole_aux = float(ref.aux_loss)
    return {"loss": abs(float(loss.detach()) - float(ref.loss)) / abs(float(ref.loss)),
            "aux": abs(float(aux.detach()) / SP_AUX - whole_aux) / whole_aux,
            "grad": max(float((grads[n] - want[n]).norm() / want[n].norm()) for n in want),
            "mean_of_shards_aux": abs(float(shard_aux) / sp.size - whole_aux) / whole_aux}
