"""The HF Trainer with a DeepSpeed config holding ``expert_parallel``, under ``shardwise launch
--as-deepspeed`` (tests/test_moe.py): the same Trainer runs with and without EP. ZeRO-2: a tiny
Mixtral built before the TrainingArguments, then ``save_model`` (accelerate's ``get_state_dict`` ->
``model.state_dict()`` on every rank, rank 0 writes). ZeRO-3: the model made by ``from_pretrained``
after the TrainingArguments, so transformers builds it under ``zero.Init``, then ``save_model``
(the consolidated state dict). Rank 0 writes ``results.json`` and each EP run's live full weights
(``<run>/live.pt``) into the folder given."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _ds(stage: int, ep: int | None) -> dict:
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}}
    if ep is not None:
        ds["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"}
    return ds


def run(out: Path, ep: int | None, stage: int, source: Path) -> dict:
    from hf_facade_job import cpu_state, dataset, losses, training_args
    from moe_cases import build, full_weights
    from transformers import AutoModelForCausalLM, Trainer

    from shardwise.moe import expert_parallel_of

    cpu_state()
    if stage == 2:
        model = build("mixtral", aux=0.02)
        args = training_args(out, batch=2, steps=4, deepspeed=_ds(stage, ep))
    else:  # as transformers' docs order it at ZeRO-3: the arguments first, then the model
        args = training_args(out, batch=2, steps=4, deepspeed=_ds(stage, ep))
        model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager")
    data = [{"input_ids": x["input_ids"] % 97, "labels": x["labels"] % 97} for x in dataset()]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(str(out / "model"))
    live = full_weights(trainer.model_wrapped)
    if torch.distributed.get_rank() == 0:
        torch.save(live, out / "live.pt")
    split = expert_parallel_of(model)
    return {"losses": losses(trainer), "ep_size": None if split is None else split.ep_size,
            "local_experts": int(model.model.layers[0].mlp.experts.gate_up_proj.shape[0])}


def main_at(root: Path) -> None:
    """The four runs into ``root`` (also run by tests/facade_launch.py's shared launch)."""
    from hf_facade_job import cpu_state
    from moe_cases import build

    cpu_state()  # the process group, before the first run makes its own state
    root.mkdir(parents=True, exist_ok=True)
    source = root / "source"
    if torch.distributed.get_rank() == 0:
        build("mixtral", aux=0.02).save_pretrained(source)
    torch.distributed.barrier()
    res = {f"{name}{stage}": run(root / f"{name}{stage}", ep, stage, source)
           for stage in (2, 3) for name, ep in (("ep", 2), ("plain", None))}
    if torch.distributed.get_rank() == 0:
        (root / "results.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main_at(Path(sys.argv[1]))
