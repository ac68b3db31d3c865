"""Sequence-parallel cases run on every rank of the pool (tests/test_sequence_parallel.py)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from shardwise.sequence_parallel import (
    SequenceParallel,
    offload_checkpoints,
    register_attention,
    sequence_parallel_loss,
    split_batch,
    tile_mlps,
    tiled_causal_lm_loss,
)
from shardwise.tensor_parallel import gather_state_dict

VOCAB = 509


def llama(impl: str = "sdpa", kv_heads: int = 1, heads: int = 4, seed: int = 0) -> torch.nn.Module:
    """A tiny HF Llama (head dim 16), dropout off; kv_heads 1 < SP 2 exercises kv replication; heads 3
    cannot be split over 2 ranks (ring attention)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16 * heads, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                      tie_word_embeddings=False)
    cfg._attn_implementation = impl
    model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def sample_batch(b: int, seq: int, seed: int = 1, pad_from: int | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if pad_from is not None:  # the last sample is right padded from pad_from on
        mask = torch.ones_like(ids)
        mask[-1, pad_from:] = 0
        batch["attention_mask"] = mask
        batch["labels"][-1, pad_from:] = -100
    return batch


def reference_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """HF's own causal-LM loss on the whole batch (mean over real target tokens)."""
    return model(**batch).loss


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sp_matches_whole(impl: str, kv_heads: int, seq: int, pad_from: int | None = None,
                     checkpointing: bool = False, heads: int = 4, attention: str = "auto") -> dict:
    """SP 2 forward + backward (gradients averaged over the SP group, as ZeRO does) against the whole batch
    in one process. ``attention``: the SP attention asked for (the one used is returned)."""
    sp = SequenceParallel.of_size(dist.get_world_size())
    model = llama(impl, kv_heads, heads)
    batch = sample_batch(2, seq, pad_from=pad_from)
    ref_model = copy.deepcopy(model)
    ref = reference_loss(ref_model, batch)
    ref.backward()
    register_attention(model, sp, attention)
    if checkpointing:  # HF activation checkpointing: attention (and its all-to-alls) recomputed in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shard = split_batch(batch, sp)
    labels = shard.pop("shift_labels")
    assert model.config.use_cache  # on in the config: the SP forward hook, not the batch, turns it off
    out = model(**shard)
    loss = sequence_parallel_loss(out.logits, labels, sp)
    loss.backward()
    cache = None if out.past_key_values is None else type(out.past_key_values).__name__
    got = _grads(model)
    for g in got.values():
        dist.all_reduce(g, group=sp.group)
        g /= sp.size
    want = _grads(ref_model)
    assert got.keys() == want.keys()
    out = {"loss": abs(float(loss.detach()) - float(ref)) / abs(float(ref)),
           "grad": max(_rel(got[n], want[n]) for n in want), "attention": sp.attention, "cache": cache}
    if checkpointing:  # the same SP step with the checkpoint inputs offloaded: bit-exact (copies move bits)
        out["offload_bit_exact"] = _offloaded_equal(model, shard, labels, sp, loss)
    return out


def _offloaded_equal(model: torch.nn.Module, shard: dict, labels: torch.Tensor, sp: SequenceParallel,
                     loss: torch.Tensor) -> bool:
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    store = offload_checkpoints(model)
    again = sequence_parallel_loss(model(**shard).logits, labels, sp)
    again.backward()
    moved = store.packed_bytes == 2 * shard["input_ids"].numel() * 64 * 4  # 2 layers' [b, s/2, 64] fp32 inputs
    same = all(torch.equal(p.grad, plain[n]) for n, p in model.named_parameters())
    return moved and same and torch.equal(again, loss)


# -- ZeRO composition: SP (x DP) training against one process on the same global data ----------------
LR, WD, BETAS, EPS, CLIP = 1e-3, 0.01, (0.9, 0.999), 1e-8, 1.0
SEQS = (16, 13, 11)  # variable lengths: 13 and 11 are not multiples of the SP degree
PAD_STEP, PAD_FROM = 1, 7  # at this step the last sample is right padded from this position on
RESUME_SEQS = (12, 16)  # steps after a checkpoint: equal lengths, no padding (per-rank means = global mean)


def step_batches(dp: int, micro: int = 2, seqs: tuple[int, ...] = SEQS, first: int = 0) -> list[list[dict]]:
    """For each step, each data-parallel replica's batch (the same on every SP rank of a replica)."""
    out = []
    for s, seq in enumerate(seqs, start=first):
        per_replica = []
        for d in range(dp):
            pad = PAD_FROM if s == PAD_STEP and d == dp - 1 else None
            per_replica.append(sample_batch(micro, seq, seed=100 * s + d + 1, pad_from=pad))
        out.append(per_replica)
    return out


def sp_config(stage: int, sp: int, world: int, micro: int = 2, tp: int = 1, **zero: object) -> dict:
    dp = world // (sp * tp)
    return {"tensor_parallel": {"autotp_size": tp},
            "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "train_batch_size": micro * dp, "gradient_clipping": CLIP, "steps_per_print": 0,
            "sequence_parallel_size": sp,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000,
                                  **zero},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": WD}}}


def _row_sum_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The batch's mean token loss computed another way: one forward per row, summed token losses."""
    total, count = 0.0, 0
    for r in range(batch["input_ids"].shape[0]):
        ids, labels = batch["input_ids"][r:r + 1], batch["labels"][r:r + 1]
        logits = model(input_ids=ids).logits.float()[:, :-1]
        target = labels[:, 1:]
        total = total + torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1),
                                                          ignore_index=-100, reduction="sum")
        count += int((target != -100).sum())
    return total / count


def reference_training(dp: int, variant: str = "plain", kv_heads: int = 1, heads: int = 4) -> dict:
    """One process, plain AdamW, the whole global batch; ``variant`` 'rows' or 'flip' are the same
    training in exact arithmetic with other summation orders (the measured noise floor)."""
    from tolerance import flip_mlp

    model = llama(kv_heads=kv_heads, heads=heads)
    if variant == "flip":
        flip_mlp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses, norms, weights = [], [], {}
    for s, replicas in enumerate(step_batches(dp, seqs=SEQS + RESUME_SEQS)):
        if s == len(SEQS):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        step_loss = 0.0
        for batch in replicas:
            loss = _row_sum_loss(model, batch) if variant == "rows" else reference_loss(model, batch)
            (loss / dp).backward()
            step_loss += float(loss.detach()) / dp
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(step_loss)
    if variant == "flip":
        flip_mlp(model)
        flip_mlp_weights(weights, kv_heads, heads)
    return {"losses": losses, "norms": norms, "weights": weights}


def flip_mlp_weights(weights: dict[str, torch.Tensor], kv_heads: int = 1, heads: int = 4) -> None:
    """tests/tolerance.flip_mlp on a dict of tensors (weights saved while the model was flipped)."""
    from tolerance import flip_mlp

    holder = llama(kv_heads=kv_heads, heads=heads)
    with torch.no_grad():
        for n, p in holder.named_parameters():
            p.copy_(weights[n])
    flip_mlp(holder)
    weights.update({n: p.detach().clone() for n, p in holder.named_parameters()})


def resume_without_sp(stage: int, save_dir: str, kv_heads: int = 1) -> dict:
    """Load a checkpoint saved under SP 2 (or TP x SP) into a plain data-parallel engine (no SP, no TP)
    and train on."""
    import shardwise

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = sp_config(stage, 1, world, micro=1)
    model = llama(kv_heads=kv_heads, seed=7)  # other initial weights: the load must win
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    engine.load_checkpoint(save_dir, tag="sp")
    losses = []
    for (batch,) in step_batches(1, micro=world, seqs=RESUME_SEQS, first=len(SEQS)):
        ids, labels = batch["input_ids"][rank:rank + 1], batch["labels"][rank:rank + 1]
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().to(torch.float64).reshape(1)
        dist.all_reduce(t)
        losses.append(float(t) / world)
    return {"losses": losses}


def sp_training(stage: int, sp_size: int, save_dir: str | None = None, inject: str | None = None,
                tiles: int | None = None, tp: int = 1, kv_heads: int = 1, tiled_loss: bool = True,
                heads: int = 4, attention: str | None = None, **zero: object) -> dict:
    """Train through shardwise.initialize with sequence_parallel_size; losses as every rank reports them.

    ``inject`` a known error, to show the test catches it: 'local' (each rank attends only to its
    own shard: SP off on split batches) or 'double' (gradients 2x, DeepSpeed's ZeRO-1/2 SP bug).
    ``tiles``: ALST's tiled MLPs and (``tiled_loss``) tiled logits + loss, with that many tiles. ``tp``: tensor
    parallelism too (TP x SP x DP = world). ``zero``: more zero_optimization keys (hybrid sharding).
    ``heads``: the model's attention heads (3: Ulysses cannot split them over 2 ranks); ``attention``:
    shardwise.sequence_parallel_attention (None: the default)."""
    import contextlib

    import shardwise
    from shardwise.zero import GatheredParameters

    world = dist.get_world_size()
    model = llama(kv_heads=kv_heads, heads=heads)
    if tiles is not None:
        tile_mlps(model, tiles)
    config = sp_config(stage, sp_size, world, tp=tp, **zero)
    if attention is not None:
        config["shardwise"] = {"sequence_parallel_attention": attention}
    engine, *_ = shardwise.initialize(model=model, config=config)
    sp = engine.sequence_parallel
    losses, norms = [], []
    for replicas in step_batches(engine.dp_world):
        shard = split_batch(replicas[engine.dp_rank], sp)
        labels = shard.pop("shift_labels")
        with sp.disabled() if inject == "local" else contextlib.nullcontext():
            if tiles is None or not tiled_loss:
                loss = sequence_parallel_loss(engine(**shard).logits, labels, sp)
            else:
                loss = tiled_causal_lm_loss(engine, shard, labels, sp, tiles=tiles)
        engine.backward(loss * 2 if inject == "double" else loss)
        engine.step()
        losses.append(float(loss.detach()))  # this replica's loss: average over replicas below
        norms.append(engine.get_global_grad_norm())
    t = torch.tensor(losses, dtype=torch.float64)
    sp.mesh.data.all_reduce(t)
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="sp")
    with GatheredParameters(engine.module.parameters()):
        weights = gather_state_dict(engine.module, engine.tp)  # whole tensors (TP slices gathered)
    return {"losses": (t / engine.dp_world).tolist(), "norms": norms, "weights": weights,
            "dp_world": engine.dp_world, "sp": sp.size, "sp_ranks": _group_ranks(sp), "attention": sp.attention}


def _group_ranks(sp: SequenceParallel) -> list[int]:
    """The global ranks of this rank's SP group, in group order."""
    mine = torch.tensor([dist.get_rank()])
    out = [torch.zeros_like(mine) for _ in range(sp.size)]
    dist.all_gather(out, mine, group=sp.group)
    return [int(t) for t in out]


def eval_mode_keeps_sp_and_generate_is_local() -> dict:
    """A model left in eval mode still exchanges heads with gradients on (no silent local attention);
    generate() under no_grad runs the model's own attention on whole sequences."""
    sp = SequenceParallel.of_size(dist.get_world_size())
    model = llama()
    plain = copy.deepcopy(model).eval()
    register_attention(model, sp)
    model.eval()
    batch = sample_batch(2, 16)
    ref = reference_loss(copy.deepcopy(plain), batch)
    shard = split_batch(batch, sp)
    labels = shard.pop("shift_labels")
    loss = sequence_parallel_loss(model(**shard).logits, labels, sp)
    prompt = batch["input_ids"][:1, :5]
    with torch.no_grad():
        got = model.generate(prompt, max_new_tokens=6, do_sample=False)
        want = plain.generate(prompt, max_new_tokens=6, do_sample=False)
    unsplit = None
    try:
        model(input_ids=batch["input_ids"])  # SP on, whole sequences, no positions: refused
    except ValueError as e:
        unsplit = str(e)
    return {"loss": abs(float(loss.detach()) - float(ref)) / float(ref), "generate_equal": bool(torch.equal(got, want)),
            "unsplit": unsplit}


def unequal_shards_refused_then_new_length() -> dict:
    """Eager attention: shards of unequal length (rank 0 keeps 8 tokens, rank 1 6) are refused on every
    rank before any exchange (the shard check, in flight from the pre-hook, awaited at the first
    attention), the group stays usable, and a new length then equals the whole batch (eager's causal
    mask, cached per length, rebuilt for it)."""
    sp = SequenceParallel.of_size(dist.get_world_size())
    model = llama("eager")
    ref_model = copy.deepcopy(model)
    register_attention(model, sp)
    shard = split_batch(sample_batch(2, 16), sp)
    shard.pop("shift_labels")
    cut = 8 if sp.rank == 0 else 6
    refused = None
    try:
        model(**{k: v[:, :cut] if isinstance(v, torch.Tensor) else v for k, v in shard.items()})
    except ValueError as e:
        refused = str(e)
    batch = sample_batch(2, 12, seed=3)
    ref = reference_loss(ref_model, batch)
    shard = split_batch(batch, sp)
    labels = shard.pop("shift_labels")
    loss = sequence_parallel_loss(model(**shard).logits, labels, sp)
    return {"refused": refused, "loss": abs(float(loss.detach()) - float(ref)) / float(ref)}


def sp_shard_api(stage: int) -> dict:
    """The functional front end with SP: setup_sequence_parallel + shard() + ShardedOptimizer +
    clip_grad_norm_ and a plain loss.backward(); every rank is one SP rank (one data replica)."""
    import shardwise
    from shardwise.sequence_parallel import setup_sequence_parallel
    from shardwise.zero import GatheredParameters

    model = llama()
    sp = setup_sequence_parallel(model, dist.get_world_size())
    shardwise.shard(model, stage=stage)
    opt = shardwise.ShardedOptimizer(model, torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses, norms = [], []
    for (batch,) in step_batches(1):
        shard = split_batch(batch, sp)
        labels = shard.pop("shift_labels")
        loss = sequence_parallel_loss(model(**shard).logits, labels, sp)
        loss.backward()
        norms.append(float(shardwise.clip_grad_norm_(model, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    with GatheredParameters(model.parameters()):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights}


def refused_windows_and_sinks() -> list[str]:
    """A forward under SP 2 that the whole-sequence attention would get wrong, each refused in one
    line: a Mistral whose sliding window (12) is shorter than the sequence (16) though longer than a
    shard (8: the mask HF builds for the shard masks nothing), and GPT-OSS's
    per-head attention sinks (its windows made longer than the sequence, so the sinks are what is
    left). A window as long as the sequence masks nothing: that Mistral runs."""
    import moe_cases
    from transformers import MistralConfig

    sp = SequenceParallel.of_size(dist.get_world_size())
    batch = sample_batch(1, 16)
    msgs = []
    for window in (12, 16):
        torch.manual_seed(0)
        cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, sliding_window=window)
        cfg._attn_implementation = "sdpa"
        msgs.append(_sp_forward_error(AutoModelForCausalLM.from_config(cfg), batch, sp))
    oss = moe_cases.moe_config("gpt_oss")
    oss.sliding_window = 64
    msgs.append(_sp_forward_error(AutoModelForCausalLM.from_config(oss), sample_batch(1, 16, pad_from=None), sp))
    return msgs


def _sp_forward_error(model: torch.nn.Module, batch: dict, sp: SequenceParallel) -> str:
    register_attention(model, sp)
    shard = split_batch({"input_ids": batch["input_ids"] % model.config.vocab_size}, sp)
    try:
        model(**shard)
    except ValueError as e:
        return str(e)
    return "ran"


def facade_sp_with_tp_refused() -> str:
    """register_with_transformers' mpu (groups cut without TP) with tensor_parallel in the config: refused."""
    import shardwise
    from shardwise.deepspeed.ulysses import UlyssesSPAttentionHF
    from shardwise.engine.compat import UsageError

    model = llama(kv_heads=2)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 2)
    try:
        shardwise.initialize(model=model, config=sp_config(2, 2, dist.get_world_size(), tp=2), mpu=mpu)
    except UsageError as e:
        return str(e)
    return "not refused"
