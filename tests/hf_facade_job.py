"""Stock Hugging Face scripts run under ``shardwise launch --as-deepspeed`` (tests/test_hf_facade.py).

Written as transformers' and accelerate's docs show them: a ``TrainingArguments(deepspeed=cfg)``
Trainer; PEFT's ``get_peft_model`` under it; an ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(
hf_ds_config=cfg))`` loop with ``prepare``, ``backward``, ``save_state`` / ``load_state``. Several
trainings run in this one launch to keep the suite fast. Rank 0 writes ``results.json`` into the
folder given as the first argument. Also importable: the pytest process builds the same models
and data for the single-process reference.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

VOCAB, SEQ, SAMPLES, STEPS, SAVE_EVERY = 128, 16, 32, 8, 4


def tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def ds_config(stage: int, **zero: object) -> dict:
    """A config as users write it for the Trainer: "auto" wherever TrainingArguments decide."""
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": stage, **zero}, "bf16": {"enabled": "auto"}}


def training_args(out: Path, batch: int, gas: int = 1, steps: int = STEPS, deepspeed: dict | None = None,
                  lr: float = 1e-3):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=gas,
                             max_steps=steps, learning_rate=lr, logging_steps=1, save_strategy="steps",
                             save_steps=SAVE_EVERY, report_to=[], seed=0, deepspeed=deepspeed,
                             dataloader_drop_last=True, disable_tqdm=True,
                             accelerator_config={"use_configured_state": deepspeed is not None})


def plain_adamw_losses(model, data, steps: int, batch: int, split: int) -> dict[int, float]:
    """The plain PyTorch reference both facade jobs compare with: AdamW at 1e-3, clipping at 1.0,
    ``batch`` samples of ``data`` per step in order, in ``split`` micro-batches (loss / split each)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = {}
    for step in range(1, steps + 1):
        ids = torch.stack([d["input_ids"] for d in data[batch * (step - 1):batch * step]])
        total = 0.0
        for part in ids.chunk(split):
            loss = model(input_ids=part, labels=part).loss / split
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out[step] = total
    return out


def cpu_state() -> None:
    """The former CPU workaround (docs/hf_trainer.md, "CPU-only machines": no longer needed, still
    honoured): accelerate picks no process-group backend for its
    DeepSpeed path without an accelerator, so the script makes the gloo state itself and the
    Trainer / Accelerator use it (``use_configured_state``). Also starts each in-process run afresh."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def trainer_run(out: Path, stage: int, steps: int = STEPS, resume: str | None = None, **zero: object):
    """Args first (so zero.Init sees the stage-3 config), then the model, as the docs order it."""
    from transformers import Trainer

    cpu_state()
    args = training_args(out, batch=2, steps=steps, deepspeed=ds_config(stage, **zero))
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def trainer_cases(root: Path) -> dict:
    res = {}
    z2 = trainer_run(root / "z2", stage=2)
    res["z2"] = losses(z2)
    res["z2_checkpoint"] = sorted(p.name for p in (root / "z2" / f"checkpoint-{SAVE_EVERY}").iterdir())
    del z2
    resumed = trainer_run(root / "z2", stage=2, resume=str(root / "z2" / f"checkpoint-{SAVE_EVERY}"))
    res["z2_resumed"] = losses(resumed)
    del resumed
    z3 = trainer_run(root / "z3", stage=3, steps=SAVE_EVERY, stage3_gather_16bit_weights_on_model_save=True)
    res["z3"] = losses(z3)
    res["z3_ds_attrs"] = stage3_attributes_hold(z3.model)
    z3.save_model(str(root / "z3_model"))
    res["z3_saved_vs_live"] = saved_vs_live(z3.model, root / "z3_model" / "model.safetensors")
    del z3
    res["lora"] = lora_case(root)
    return res


def stage3_attributes_hold(model) -> bool:
    """DeepSpeed's stage-3 marks: full sizes on every parameter; the ds_tensor pieces of all ranks
    add up to the whole parameter."""
    params = list(model.parameters())
    whole = all(p.ds_numel == p.numel() and tuple(p.ds_shape) == tuple(p.shape) for p in params)
    pieces = torch.tensor([p.ds_tensor.numel() for p in params])
    torch.distributed.all_reduce(pieces)
    ids = {p.ds_id for p in params}
    return whole and len(ids) == len(params) and pieces.tolist() == [p.numel() for p in params]


def lora_case(root: Path) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer

    cpu_state()
    args = training_args(root / "lora", batch=2, steps=SAVE_EVERY, lr=1e-2,
                         deepspeed=ds_config(3, stage3_gather_16bit_weights_on_model_save=True))
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   lora_dropout=0.0))
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train()
    trainer.save_model(str(root / "lora_model"))
    return {"losses": losses(trainer),
            "saved_vs_live": saved_vs_live(trainer.model, root / "lora_model" / "adapter_model.safetensors")}


def saved_vs_live(model, path: Path) -> float | None:
    """Largest difference between a saved file's tensors and the live (gathered) parameters of the
    same names (PEFT drops the adapter name "default" when saving); None on ranks other than 0."""
    import deepspeed  # the facade: this script runs under `shardwise launch --as-deepspeed`
    from safetensors.torch import load_file

    params = dict(model.named_parameters())
    saved = load_file(path) if int(os.environ.get("RANK", "0")) == 0 else None
    with deepspeed.zero.GatheredParameters(list(params.values())):
        if saved is None:
            return None
        live = {n.replace(".default.", "."): p.detach() for n, p in params.items()}
        assert set(saved) <= set(live), sorted(set(saved) - set(live))[:3]
        return max(float((saved[n].float() - live[n].float()).abs().max()) for n in saved)


def accelerate_run(root: Path, stage: int, resume: bool) -> dict[int, float]:
    """A plain Accelerate loop: steps 1-8 saving at 4, or (resume) load step 4's state and run 5-8."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    cpu_state()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    return run_loop(accelerator, root / f"acc{stage}", resume)


def run_loop(accelerator, out: Path, resume: bool) -> dict[int, float]:
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=2, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    start = SAVE_EVERY if resume else 0
    if resume:
        accelerator.load_state(str(out / "state"))
    seen = {}
    for step, batch in enumerate(loader, start=1):
        if step <= start:
            continue
        loss = model(**batch).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        seen[step] = accelerator.reduce(loss.detach(), "mean").item()
        if step == SAVE_EVERY and not resume:
            accelerator.save_state(str(out / "state"))
        if step == STEPS:
            break
    return seen


def main() -> None:
    import deepspeed

    assert deepspeed.__version__.endswith("+shardwise"), deepspeed  # the facade, even if one is installed
    main_at(Path(sys.argv[1]), sys.argv[2:] or ["trainer", "accelerate"])


def main_at(root: Path, parts: list[str]) -> None:
    """Every training of ``parts`` into ``root`` (also run by tests/facade_launch.py's shared launch)."""
    root.mkdir(parents=True, exist_ok=True)
    res = {}
    if "trainer" in parts:
        res["trainer"] = trainer_cases(root)
    for stage in (2, 3) if "accelerate" in parts else ():
        res[f"acc{stage}"] = accelerate_run(root, stage, resume=False)
        res[f"acc{stage}_resumed"] = accelerate_run(root, stage, resume=True)
    if int(os.environ.get("RANK", "0")) == 0:
        (root / "results.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
