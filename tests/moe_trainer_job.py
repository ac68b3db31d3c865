"""The HF Trainer with a DeepSpeed config holding ``expert_parallel``, under ``shardwise launch
--as-deepspeed`` (tests/test_moe.py): the same Trainer run with and without EP, ZeRO-2, a tiny Mixtral
built before the TrainingArguments. Rank 0 writes ``results.json`` into the folder given."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(out: Path, ep: int | None) -> dict:
    from hf_facade_job import cpu_state, dataset, losses, training_args
    from moe_cases import build
    from transformers import Trainer

    cpu_state()
    model = build("mixtral", aux=0.02)
    model.config.vocab_size = 97
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}
    if ep is not None:
        ds["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"}
    data = [{"input_ids": x["input_ids"] % 97, "labels": x["labels"] % 97} for x in dataset()]
    trainer = Trainer(model=model, args=training_args(out, batch=2, steps=4, deepspeed=ds), train_dataset=data)
    trainer.train()
    from shardwise.moe import expert_parallel_of

    split = expert_parallel_of(model)
    return {"losses": losses(trainer), "ep_size": None if split is None else split.ep_size,
            "local_experts": int(model.model.layers[0].mlp.experts.gate_up_proj.shape[0])}


if __name__ == "__main__":
    root = Path(sys.argv[1])
    res = {"ep": run(root / "ep", 2), "plain": run(root / "plain", None)}
    if torch.distributed.get_rank() == 0:
        (root / "results.json").write_text(json.dumps(res))
