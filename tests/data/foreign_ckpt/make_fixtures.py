"""Regenerate the foreign checkpoint fixtures (DeepSpeed 0.19.8 engine, FSDP2 + DCP) in this folder.

Run once, in a venv of its own that has DeepSpeed (never the project's: its tests need it absent)::

    python3 -m venv /work/venv-ds
    /work/venv-ds/bin/pip install torch==2.13.0 deepspeed==0.19.8 transformers==5.24.0 accelerate
    cd tests/data/foreign_ckpt && DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/tmp/ds_ext OMP_NUM_THREADS=1 \
        /work/venv-ds/bin/torchrun --nproc-per-node 2 make_fixtures.py
    # the HF Trainer's checkpoint (needs transformers + accelerate in that venv):
    ... /work/venv-ds/bin/torchrun --nproc-per-node 2 make_fixtures.py hf

Each case trains the model of ``tests/foreign_ckpt_model.py`` for SAVE_AT steps on 2 gloo ranks,
saves, and continues to STEPS; ``losses.json`` records every rank's losses of that uninterrupted
run (what a resume must reproduce), and ``reference`` the losses of plain single-process PyTorch
(full global batch, torch AdamW, the same warmup) for the resharded comparisons, and
``CASE/final.safetensors`` the fp32 weights each run ended with. DeepSpeed's copies of its
conversion scripts (``zero_to_*.py``) are removed from each folder (not part of the checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/
from foreign_ckpt_model import ADAMW, SAVE_AT, STEPS, WARMUP, batch, build, ds_config  # noqa: E402

DS_CASES = {"ds_z1": (1, False, False), "ds_z2_frozen": (2, False, True), "ds_z2_bf16": (2, True, False),
            "ds_z3_frozen": (3, False, True), "ds_z3_bf16": (3, True, False)}


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def deepspeed_case(name: str, stage: int, bf16: bool, frozen: bool) -> list[float]:
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(frozen=frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True, **ADAMW)
    cfg = {**ds_config(stage, world, bf16), "zero_allow_untested_optimizer": True,
           "zero_force_ds_cpu_optimizer": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    out, losses = HERE / name, []
    for step in range(STEPS):
        if step == SAVE_AT:
            engine.save_checkpoint(str(out), client_state={"epoch": 3, "note": "halfway"})
        loss = engine(input_ids=batch(step, rank, world).to(engine.device), labels=batch(step, rank, world))
        engine.backward(loss.loss)
        engine.step()
        losses.append(float(loss.loss))
    from deepspeed.utils import safe_get_full_fp32_param

    final = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()
             if p.requires_grad}  # collective at stage 3
    if rank == 0:
        _save_final(out, final)
        for script in out.glob("zero_to_*.py"):
            script.unlink()
    return losses


def _save_final(out: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({n: t.float().contiguous() for n, t in weights.items()}, str(out / "final.safetensors"))


def fsdp2_case(name: str) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(HERE / name))
        loss = _loss(model, batch(step, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    final = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        _save_final(HERE / name, final)
    return losses


def warmup_lr(step: int) -> float:
    """DeepSpeed's linear WarmupLR at optimizer step ``step`` (0-based): the engine steps the scheduler
    after each optimizer step from iteration -1, so steps 0 and 1 both run at iteration 0's lr."""
    frac = min(max(step - 1, 0) / WARMUP["warmup_num_steps"], 1.0)
    return WARMUP["warmup_min_lr"] + (WARMUP["warmup_max_lr"] - WARMUP["warmup_min_lr"]) * frac


def reference(frozen: bool, constant_lr: bool) -> list[float]:
    """Plain single-process PyTorch on the whole global batch."""
    model = build(frozen=frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True, **ADAMW)
    losses = []
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = ADAMW["lr"] if constant_lr else warmup_lr(step)
        loss = _loss(model, batch(step, 0, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.cat([batch(s, 0, 1) for s in range(STEPS)])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_trainer_case(name: str) -> None:
    """The HF Trainer with DeepSpeed ZeRO-2 (its optimizer: torch AdamW; constant lr), saving at
    step SAVE_AT: ``hf_trainer_z2/checkpoint-2/`` holds DeepSpeed's ``latest`` + ``global_step2/``
    beside the Trainer's own files (``model.safetensors``: the weights at that step)."""
    from transformers import Trainer, TrainingArguments

    world = dist.get_world_size()
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
           "zero_force_ds_cpu_optimizer": False}
    args = TrainingArguments(output_dir=str(HERE / name), per_device_train_batch_size=4 // world, max_steps=SAVE_AT,
                             save_strategy="steps", save_steps=SAVE_AT, learning_rate=ADAMW["lr"],
                             adam_beta1=ADAMW["betas"][0], adam_beta2=ADAMW["betas"][1], adam_epsilon=ADAMW["eps"],
                             weight_decay=ADAMW["weight_decay"], lr_scheduler_type="constant", warmup_steps=0,
                             max_grad_norm=0.0, deepspeed=cfg, report_to=[], logging_steps=1, use_cpu=True,
                             save_only_model=False, dataloader_num_workers=0, seed=0, optim="adamw_torch")
    Trainer(model=build(), args=args, train_dataset=_Tokens()).train()
    dist.barrier()
    if dist.get_rank() == 0:
        ckpt = HERE / name / f"checkpoint-{SAVE_AT}"
        for f in [*ckpt.glob("zero_to_*.py"), *ckpt.glob("rng_state_*.pth"), ckpt / "training_args.bin"]:
            f.unlink(missing_ok=True)


def main() -> None:
    if sys.argv[1:] == ["hf"]:
        dist.init_process_group("gloo")
        shutil.rmtree(HERE / "hf_trainer_z2", ignore_errors=True)
        hf_trainer_case("hf_trainer_z2")
        dist.destroy_process_group()
        return
    dist.init_process_group("gloo")
    record: dict = {"world": dist.get_world_size(), "save_at": SAVE_AT, "steps": STEPS, "runs": {}}
    for name, (stage, bf16, frozen) in DS_CASES.items():
        shutil.rmtree(HERE / name, ignore_errors=True)
        dist.barrier()
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, deepspeed_case(name, stage, bf16, frozen))
        record["runs"][name] = got
    shutil.rmtree(HERE / "fsdp2_dcp", ignore_errors=True)
    dist.barrier()
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, fsdp2_case("fsdp2_dcp"))
    record["runs"]["fsdp2_dcp"] = got
    if dist.get_rank() == 0:
        record["reference"] = {"warmup": reference(False, False), "warmup_frozen": reference(True, False),
                               "constant": reference(False, True)}
        (HERE / "losses.json").write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(record, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
