"""Rank-side training runs and their single-process reference (used by test_zero*.py)."""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from tiny_models import batches, build
from tolerance import equivalence_tol, flip_mlp

import shardwise
from shardwise.zero import GatheredParameters

LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8


def make_config(stage: int, *, precision: str = "fp32", micro: int = 2, gas: int = 1, clip: float = 0.0,
                offload: bool = False, overlap: bool = False, bucket: int = 20_000, dp: int = 2,
                optimizer: bool = True, tp: int = 1, **zero_extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * dp,
        "gradient_clipping": clip,
        "steps_per_print": 0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                              "overlap_comm": overlap, **zero_extra},
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                        "weight_decay": WD}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def train_ranks(kind: str, config: dict, steps: int = 3, seq: int = 16, client_optimizer: bool = False,
                pretrained: str | None = None) -> dict:
    """Train on this rank's slice of the same global batches the reference sees.

    ``pretrained``: build the model under ``shardwise.zero.Init`` from that saved folder.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if pretrained is not None:
        from transformers import AutoModelForCausalLM

        with shardwise.zero.Init():
            model = AutoModelForCausalLM.from_pretrained(pretrained)
        model.train()
    else:
        model = build(kind)
    micro, gas = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    tp = config.get("tensor_parallel", {}).get("autotp_size", 1)
    dp_world, dp_rank = world // tp, rank // tp  # TP groups are consecutive ranks
    data = batches(steps, gas, micro * dp_world, seq)
    opt = None
    if client_optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    engine, _, _, _ = shardwise.initialize(model=model, config=config, model_parameters=None, optimizer=opt)
    losses = run_micro_batches(engine, data, dp_rank, micro)
    files = getattr(model, "_shardwise_files", None)
    result = {"bytes_read": files.bytes_read if files is not None else None,
              "losses": losses, "memory": engine.memory_report(), "comm": engine.comm_stats(),
              "skipped": engine.skipped_steps, "global_steps": engine.global_steps,
              "numel": sum(p.numel() for p in model.parameters()),
              "buckets_in_use": engine.groups[0].inflight.in_use if engine.groups else None,
              "largest_group_bytes": max((g.padded_numel * g.flat_param.element_size() for g in engine.groups),
                                         default=0)}
    if engine.groups:
        g = engine.groups[0]
        result["master_device"] = str(g.master.device)
        result["master_is_view"] = g.master_is_view
        result["opt_state_devices"] = sorted({str(v.device) for st in engine.optimizer.state.values()
                                              for v in st.values() if torch.is_tensor(v)})
    out_emb = model.get_output_embeddings()
    result["tied"] = out_emb is not None and out_emb.weight is model.get_input_embeddings().weight
    result["shapes_outside_forward"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    with GatheredParameters(model.parameters()):  # a no-op below stage 3
        if tp > 1:
            from shardwise.tensor_parallel import gather_state_dict

            weights = {n: t.float() for n, t in gather_state_dict(model, engine.tp).items()}
        else:
            weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    if rank == 0:
        result["weights"] = weights
    return result


def run_micro_batches(engine, data: torch.Tensor, dp_rank: int, micro: int) -> list[float]:
    """Every micro-batch of ``data`` (steps x gas x global batch x seq), this rank's slice, through
    forward/backward/step; the per-micro-batch losses."""
    losses = []
    for s in range(data.shape[0]):
        for m in range(data.shape[1]):
            ids = data[s, m, dp_rank * micro:(dp_rank + 1) * micro]
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
            losses.append(float(out.loss.detach()))
    return losses


def reference(kind: str, config: dict, world: int = 2, steps: int = 3, seq: int = 16,
              noise: bool = True) -> dict:
    """Plain PyTorch, one process: AdamW over the same global batch, same loss averaging.

    With ``noise`` the same training runs again with other micro-batch splits (one forward over
    the whole global micro batch, and one forward per row: other GEMM shapes and summation
    orders) and the result carries ``noise`` (how far those exact-arithmetic-equal runs landed
    from it) and ``tol``, the bound derived from it (tests/tolerance.py), so the bound follows
    the CPU's kernels instead of one machine's.

    The run reads only the batch, accumulation and clipping keys of ``config`` (not the stage), so
    it is made once per test process for those (26 of a run's 59 calls were the same one) and each
    caller gets a copy of its own.
    """
    keys = (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config.get("gradient_clipping", 0.0))
    with torch.random.fork_rng(devices=[]):  # the caller's RNG as it was, made now or before
        return copy.deepcopy(_reference(kind, *keys, world, steps, seq, noise))


@functools.cache
def _reference(kind: str, micro: int, gas: int, clip: float, world: int, steps: int, seq: int, noise: bool) -> dict:
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": clip}
    ref = _reference_run(kind, config, world, steps, seq, chunks=None)
    if noise:
        rows = config["train_micro_batch_size_per_gpu"] * world
        others = [_reference_run(kind, config, world, steps, seq, chunks=c) for c in sorted({1, rows})]
        others.append(_reference_run(kind, config, world, steps, seq, chunks=None, flip=True))
        ref["noise"] = measured_noise(ref, others)
        ref["tol"] = equivalence_tol(ref["noise"], steps)
    return ref


def row_losses(model, ids: torch.Tensor) -> torch.Tensor:
    """Each row's mean next-token loss (HF's causal-LM loss of that row alone)."""
    logits = model(input_ids=ids).logits.float()
    per_token = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                  ids[:, 1:].reshape(-1), reduction="none")
    return per_token.view(ids.shape[0], -1).mean(dim=1)


def _reference_run(kind: str, config: dict, world: int, steps: int, seq: int, chunks: int | None,
                   flip: bool = False) -> dict:
    """``chunks``: None = one forward per rank's micro batch; else that many forwards over all rows.
    ``flip``: train with the MLP hidden units reversed (tests/tolerance.py flip_mlp), undone at the end."""
    torch.manual_seed(0)
    model = build(kind)
    if flip:
        flip_mlp(model)
    micro, gas = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    clip = config.get("gradient_clipping", 0.0)
    data = batches(steps, gas, micro * world, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = {r: [] for r in range(world)}
    for s in range(steps):
        opt.zero_grad(set_to_none=False)
        for m in range(gas):
            if chunks is None:
                per_rank = []
                for r in range(world):
                    ids = data[s, m, r * micro:(r + 1) * micro]
                    loss = model(input_ids=ids, labels=ids).loss
                    (loss / (gas * world)).backward()
                    per_rank.append(float(loss.detach()))
            else:  # equal tokens per row: the mean of row losses is the batch loss
                rows = []
                for ids in data[s, m].chunk(chunks):
                    per_row = row_losses(model, ids)
                    (per_row.sum() / (micro * gas * world)).backward()
                    rows.append(per_row.detach())
                per_row = torch.cat(rows)
                per_rank = [float(per_row[r * micro:(r + 1) * micro].mean()) for r in range(world)]
            for r, loss in enumerate(per_rank):
                losses[r].append(loss)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    if flip:
        flip_mlp(model)
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def measured_noise(ref: dict, others: list[dict]) -> dict:
    """Worst distance of exact-arithmetic-equal runs from ``ref``: weights and losses (relative).

    Weights: max |a - b| / max |b| per tensor with no floor subtracted (``max_rel_diff(floor=0)``),
    so it sees the elements Adam amplifies; GPT-2's key bias, whose gradient is analytically zero
    (its steps are pure noise at any precision), is left out (``without_key_bias``).
    """
    weights = max(max_rel_diff(without_key_bias(o["weights"]), without_key_bias(ref["weights"]), floor=0.0)
                  for o in others)
    loss = max((abs(a - b) / max(abs(b), 1e-12) for o in others for r in ref["losses"]
                for a, b in zip(o["losses"][r], ref["losses"][r], strict=True)), default=0.0)
    return {"weights": weights, "loss": loss}


def without_key_bias(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2's attention key bias zeroed (softmax ignores a per-query shift: its gradient is 0)."""
    out = dict(weights)
    for n, t in weights.items():
        if n.endswith("attn.c_attn.bias"):
            h = t.numel() // 3
            out[n] = t.clone()
            out[n][h:2 * h] = 0.0
    return out


# Elements whose exact gradient is 0 but whose computed gradient is round-off noise (GPT-2's key
# bias: softmax is shift invariant) take O(lr) Adam steps in the noise's direction, which differs
# with reduction order. An absolute floor of 1% of one step covers them and nothing else.
NOISE_FLOOR = 1e-2 * LR


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], floor: float = NOISE_FLOOR) -> float:
    """Worst over tensors of (max |a - b| - floor) / max |b|."""
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        d = (a[k].float() - b[k].float()).abs().max().item() - floor
        worst = max(worst, d / max(b[k].float().abs().max().item(), 1e-12))
    return worst


def assert_same_bits(runs_a: list[dict], runs_b: list[dict]) -> None:
    """(In the test process.) Two pool runs' per-rank results agree to the bit: losses and every weight."""
    for a, b in zip(runs_a, runs_b, strict=True):
        assert a["losses"] == b["losses"]
        assert a["weights"].keys() == b["weights"].keys()
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def no_sync_stage2() -> None:
    engine, *_ = shardwise.initialize(model=build("llama"), config=make_config(2))
    with engine.no_sync():
        pass


def desync() -> None:
    """Rank 1 skips a collective that rank 0 makes: both must fail, not hang."""
    from shardwise.comm import Comm

    comm = Comm()
    t = torch.ones(4)
    if dist.get_rank() == 0:
        comm.all_reduce(t)
    comm.all_reduce(t)
    comm.barrier()


def update_rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], kind: str) -> float:
    """||got - ref|| / ||ref - initial||: error relative to how far training moved the weights."""
    w0 = dict(build(kind).named_parameters())
    num = sum(((got[k].float() - ref[k]) ** 2).sum() for k in ref)
    den = sum(((w0[k].detach() - ref[k]) ** 2).sum() for k in ref)
    return float((num / den).sqrt())


def dataloader_and_logging() -> dict:
    """training_data gives each rank distinct micro-batches; steps_per_print prints on rank 0 only."""
    import contextlib
    import io

    dataset = [{"input_ids": torch.full((8,), i), "labels": torch.full((8,), i)} for i in range(16)]
    cfg = make_config(1, micro=2)
    cfg["steps_per_print"] = 2
    printed = io.StringIO()
    engine, _, loader, _ = shardwise.initialize(model=build("llama"), config=cfg, training_data=dataset)
    seen = []
    with contextlib.redirect_stdout(printed):
        for batch in loader:
            seen += batch["input_ids"][:, 0].tolist()
            out = engine(**batch)
            engine.backward(out.loss)
            engine.step()
    logs = [ln.removeprefix("[shardwise] ") for ln in printed.getvalue().splitlines()]
    return {"seen": seen, "batch": list(batch["input_ids"].shape), "logs": logs,
            "steps": engine.global_steps, "lr": engine.get_lr()}


def client_scheduler() -> list[float]:
    cfg = make_config(2)
    sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))  # noqa: E731
    engine, _, _, lr_sched = shardwise.initialize(model=build("llama"), config=cfg, lr_scheduler=sched)
    lrs = []
    ids = batches(1, 1, 2, 8)[0, 0, :2]
    for _ in range(3):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        lrs.append(engine.get_lr()[0])
    return lrs


HF_TRAINER_ZERO3 = {  # the Hugging Face docs' ZeRO-3 config, "auto" everywhere the Trainer fills in
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def hf_auto_config_trains() -> dict:
    """A DeepSpeed config written for the HF Trainer loads unchanged and trains."""
    engine, *_ = shardwise.initialize(model=build("llama"), config=HF_TRAINER_ZERO3)
    ids = batches(2, 1, 2, 8)
    losses = []
    for s in range(2):
        out = engine(input_ids=ids[s, 0, :1], labels=ids[s, 0, :1])
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
    c = engine.config
    return {"losses": losses, "stage": engine.stage, "micro": c.train_micro_batch_size_per_gpu,
            "tbs": c.train_batch_size, "clip": c.gradient_clipping, "lr": engine.get_lr()[0],
            "bucket": c.zero_optimization.reduce_bucket_size}


def deepspeed_accessors() -> dict:
    """The engine methods DeepSpeed scripts (and the HF Trainer) call."""
    engine, *_ = shardwise.initialize(model=build("llama"), config=make_config(2, gas=2, clip=1.0))
    ids = batches(1, 1, 2, 8)[0, 0, :2]
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return {"tbs": engine.train_batch_size(), "micro": engine.train_micro_batch_size_per_gpu(),
            "gas": engine.gradient_accumulation_steps(), "stage": engine.zero_optimization_stage(),
            "norm": engine.get_global_grad_norm(), "applied": engine.was_step_applied(),
            "device": str(engine.device), "world": engine.world_size, "local_rank": engine.local_rank}
