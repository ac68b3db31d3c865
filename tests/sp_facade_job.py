"""A stock HF Trainer with ``parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed")`` run
under ``shardwise launch --as-deepspeed`` (tests/test_sp_facade.py): the path transformers 5.24 and
Accelerate 1.16 take for DeepSpeed's Ulysses SP (register_with_transformers, the data loader adapter,
``deepspeed.utils.groups``, ``initialize(mpu=...)``, the Trainer's all-gathered SP loss). Rank 0 writes
``results.json`` (per-step losses and gradient norms) into the folder given as the first argument.
Also importable: the pytest process runs the same Trainer without SP as the reference.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_facade_job import cpu_state, plain_adamw_losses  # noqa: E402

VOCAB, SEQ, SAMPLES, STEPS, SPDP_STEPS = 128, 15, 16, 6, 3  # 15 tokens: not a multiple of the SP degree (padded)
# SP 2 x DP 2, sequential sampling: the loader gives rank r batch r of each 4; the SP adapter of
# group [0, 1] trains rank 0's batch, then rank 1's, and group [2, 3] rank 2's, then rank 3's, so
# step 1 sees samples 0, 1 and 4, 5, step 2 samples 2, 3 and 6, 7: one process reads them in this order.
SPDP_ORDER = [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]


def tiny_llama(kv_heads: int = 1):
    """kv heads 1 < SP 2: replicated to both ranks by the exchange."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg)


def tiny_moe(experts: str = "default"):
    """Qwen3-MoE (tests/moe_cases.py, sdpa, router aux loss at ``moe_cases.SP_AUX``); ``experts``: its
    experts kernel (``"eager"``: the reference again with other summation orders, the noise floor)."""
    import moe_cases

    model = moe_cases.build("qwen3_moe", attn="sdpa", aux=moe_cases.SP_AUX)
    if experts != "default":
        model.config._experts_implementation = experts
    return model


def moe_dataset() -> list[dict[str, torch.Tensor]]:
    """Samples for the MoE model, every other one right padded from token 9 (mask 0, labels -100): the
    no-SP run leaves the pads out of the aux loss through its attention_mask, SP through the adapter's
    token mask."""
    import moe_cases

    g = torch.Generator().manual_seed(2)
    rows = []
    for i, x in enumerate(torch.randint(0, moe_cases.VOCAB, (SAMPLES, SEQ), generator=g)):
        mask, labels = torch.ones_like(x), x.clone()
        if i % 2:
            mask[9:], labels[9:] = 0, -100
        rows.append({"input_ids": x, "attention_mask": mask, "labels": labels})
    return rows


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def args(out: Path, deepspeed: dict | None = None, sp: int = 1, batch: int = 2, gas: int = 1, steps: int = STEPS,
         sampling: str = "random", checkpointing: bool = False):
    from transformers import TrainingArguments

    extra = {}
    if sp > 1:
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        dp = int(os.environ.get("WORLD_SIZE", "1")) // sp  # the data-parallel replicas, as accelerate's docs set them
        extra["parallelism_config"] = ParallelismConfig(
            sp_size=sp, sp_backend="deepspeed", dp_shard_size=dp,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    return TrainingArguments(output_dir=str(out), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=gas, max_steps=steps, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to=[], seed=0, deepspeed=deepspeed,
                             dataloader_drop_last=True, disable_tqdm=True, max_grad_norm=1.0,
                             train_sampling_strategy=sampling, activation_checkpointing=checkpointing,
                             accelerator_config={"use_configured_state": deepspeed is not None}, **extra)


def history(trainer) -> dict[str, dict[int, float]]:
    rows = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": {h["step"]: h["loss"] for h in rows}, "grad_norm": {h["step"]: h["grad_norm"] for h in rows}}


def run(out: Path, stage: int | None, sp: int = 1, batch: int = 2, gas: int = 1, steps: int = STEPS,
        order: list[int] | None = None, offload: bool = False, moe: str | None = None, ep: int | None = None) -> dict:
    """The Trainer at ``stage`` (None: no DeepSpeed); ``order``: the samples in this order, not shuffled;
    ``offload``: activation checkpointing with its inputs offloaded (``shardwise.offload_activation_checkpoints``
    in the DeepSpeed config), and the bytes the offload moved in the result; ``moe``: ``tiny_moe`` on
    ``moe_dataset`` instead of Llama (``"default"`` or ``"eager"``: its experts kernel); ``ep``: DeepSpeed
    AutoEP's ``expert_parallel`` section in the config, the experts split over ``ep`` ranks."""
    from transformers import Trainer

    deepspeed = None
    if stage is not None:
        cpu_state()
        deepspeed = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                     "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                     "zero_optimization": {"stage": stage}}
        if offload:
            deepspeed["shardwise"] = {"offload_activation_checkpoints": True}
        if ep is not None:
            deepspeed["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "qwen3_moe"}
    rows = dataset() if moe is None else moe_dataset()
    data = rows if order is None else [rows[i] for i in order]
    sampling = "random" if order is None else "sequential"
    model = tiny_llama() if moe is None else tiny_moe(moe)
    trainer = Trainer(model=model, args=args(out, deepspeed, sp, batch, gas, steps, sampling, offload),
                      train_dataset=data)
    trainer.train()
    if offload:
        return {**history(trainer), "offloaded_bytes": trainer.model_wrapped.checkpoint_offload.packed_bytes}
    return history(trainer)


def accelerate_loop(stage: int, steps: int = STEPS, moe: bool = False) -> dict[int, float]:
    """Accelerate's documented SP loop: prepare(model, optimizer, loader) wraps the loader in the SP
    adapter; the loss is the SP ranks' token-weighted mean through torch's differentiable all-gather
    (whose gloo backward fails for SP groups without rank 0 unless the facade serves it: at 4 ranks,
    SP 2 x DP 2, the samples of ``SPDP_ORDER``). The model is left in eval mode, as from_pretrained
    returns it and the documented loop leaves it. Each step's loss is the mean over the replicas.
    ``moe``: ``tiny_moe`` on ``moe_dataset``, the loop adding ``router_aux_loss_coef * outputs.aux_loss``
    (the facade makes it the whole sequence's)."""
    import moe_cases
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig
    from deepspeed.utils import groups

    cpu_state()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage}}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pc = ParallelismConfig(sp_size=2, sp_backend="deepspeed", dp_shard_size=world // 2,
                           sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))
    # before the stage-3 plugin exists: no zero.Init, the reference's initial weights
    model = (tiny_moe() if moe else tiny_llama()).eval()
    vocab = moe_cases.VOCAB if moe else VOCAB
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), parallelism_config=pc)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(moe_dataset() if moe else dataset(), batch_size=2, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    group, world = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_world_size()
    seen = {}
    for step, batch in enumerate(loader, start=1):
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}  # the usual move: tensors only
        shift_labels = batch["shift_labels"]
        outputs = model(**batch)
        loss = model.module.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                          vocab_size=vocab)
        losses = torch.distributed.nn.functional.all_gather(loss, group=group)
        good = torch.distributed.nn.functional.all_gather((shift_labels != -100).sum(), group=group)
        loss = sum(losses[r] * good[r] for r in range(world)) / max(sum(good), 1)
        if moe:
            loss = loss + model.module.config.router_aux_loss_coef * outputs.aux_loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)  # every rank holds its replica's loss: the mean over replicas
        seen[step] = float(mean) / torch.distributed.get_world_size()
        if step == steps:
            break
    return seen


def deepspeed_loop(stage: int, steps: int = STEPS) -> dict[int, float]:
    """DeepSpeed's own Ulysses SP recipe through the facade, DeepSpeed 0.19.8's API only:
    ``register_with_transformers`` -> mpu, ``initialize(mpu=...)``, ``UlyssesSPDataLoaderAdapter`` over a
    loader whose batches carry ``position_ids`` (0.19.8's adapter requires them), every value moved with
    ``.to(device)``, the SP ranks' mean losses weighted by their token counts (torch's differentiable
    all-gather), ``engine.backward`` / ``engine.step``. The samples, optimizer and clipping of
    ``accelerate_loop``, so ``reference_loop`` is its reference too."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # a DeepSpeed script has no Accelerate plugin: no zero.Init left from one
    model = tiny_llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=2, micro_batch_size=2)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=cfg, mpu=mpu)
    # each rank's loader reads its own batches (rank r: batches r, r + world, ...), as a DeepSpeed script
    # shards its loader; the adapter trains the SP ranks' batches in turn: batch 0, 1, 2, ... in order
    rank, ranks = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = [{**r, "position_ids": torch.arange(SEQ)} for r in dataset()]
    rows = [rows[i] for b in range(rank, SAMPLES // 2, ranks) for i in (2 * b, 2 * b + 1)]
    group = groups._get_sequence_parallel_group()
    world = groups._get_sequence_parallel_world_size()
    loader = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader(rows, batch_size=2, shuffle=False),
                                        sp_rank=groups._get_sequence_parallel_rank(), sp_group=group,
                                        sp_world_size=world, device=engine.device)
    seen = {}
    for step, batch in enumerate(loader, start=1):
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        shift_labels = batch["shift_labels"]
        outputs = engine(**batch)
        loss = engine.module.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                           vocab_size=VOCAB)
        losses = torch.distributed.nn.functional.all_gather(loss, group=group)
        good = torch.distributed.nn.functional.all_gather((shift_labels != -100).sum(), group=group)
        loss = sum(losses[r] * good[r] for r in range(world)) / max(sum(good), 1)
        engine.backward(loss)
        engine.step()
        seen[step] = float(loss.detach())
        if step == steps:
            break
    return seen


def reference_moe_loop(experts: str = "default") -> dict[int, float]:
    """The MoE Accelerate loop in plain PyTorch, one process: the model's own loss (its aux loss over
    the batch, pads left out by the attention mask), AdamW, clipping at 1.0, batches of 2 in order;
    ``experts``: ``tiny_moe``'s kernel (``"eager"``: the noise floor)."""
    model, rows = tiny_moe(experts), moe_dataset()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = {}
    for step in range(1, STEPS + 1):
        batch = {k: torch.stack([r[k] for r in rows[2 * (step - 1):2 * step]]) for k in rows[0]}
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out[step] = loss.item()
    return out


def reference_loop(split: int = 1, replicas: int = 1) -> dict[int, float]:
    """The Accelerate loop in plain PyTorch, one process: AdamW, clipping at 1.0, batches of 2 in order
    (``replicas`` 2: batches of 4 in ``SPDP_ORDER``, what SP 2 x DP 2 trains per step)."""
    if replicas == 1:
        return plain_adamw_losses(tiny_llama(), dataset(), STEPS, 2, split)
    data = [dataset()[i] for i in SPDP_ORDER]
    return plain_adamw_losses(tiny_llama(), data, SPDP_STEPS, 2 * replicas, split)


def main() -> None:
    import deepspeed

    assert deepspeed.__version__.endswith("+shardwise"), deepspeed
    main_at(Path(sys.argv[1]), spdp=sys.argv[2:] == ["spdp"])


def main_at(root: Path, spdp: bool = False) -> None:
    """The 2-rank cases (``spdp``: the 4-rank ones) into ``root`` (the 2-rank ones are also run by
    tests/facade_launch.py's shared launch)."""
    root.mkdir(parents=True, exist_ok=True)
    if spdp:  # 4 ranks: SP 2 x DP 2, the SP groups [0, 1] and [2, 3]
        res = {"spdp": run(root / "spdp", 2, sp=2, steps=SPDP_STEPS, order=list(range(SAMPLES))),
               "acc_spdp": accelerate_loop(2, steps=SPDP_STEPS)}
    else:
        res = {f"z{stage}": run(root / f"z{stage}", stage, sp=2) for stage in (2, 3)}
        res["z3_offload"] = run(root / "z3_offload", 3, sp=2, offload=True)
        res["moe"] = run(root / "moe", 2, sp=2, moe="default")
        res["moe_ep"] = run(root / "moe_ep", 2, sp=2, moe="default", ep=2)  # SP 2 and EP 2 on the same ranks
        res.update({f"acc{stage}": accelerate_loop(stage) for stage in (1, 3)})
        res["acc_moe"] = accelerate_loop(2, moe=True)
        res.update({f"ds{stage}": deepspeed_loop(stage) for stage in (2, 3)})
    if int(os.environ.get("RANK", "0")) == 0:
        (root / "results.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
