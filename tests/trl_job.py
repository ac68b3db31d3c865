"""Stock TRL scripts (SFT, DPO with a reference model, GRPO) at ZeRO-3 under
``shardwise launch --as-deepspeed`` (tests/test_trl_facade.py), with no DeepSpeed installed.

Written as TRL's docs show them: a ``*Config(deepspeed=cfg)`` and a trainer. Every training of one
launch runs in this process to keep the suite fast; rank 0 writes ``results.json`` into the folder
given as the first argument. Also importable: the pytest process builds the same models, data and
arguments for the single-process references (``deepspeed=None``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_facade_job import cpu_state, losses, saved_vs_live  # noqa: E402

VOCAB, STEPS = 64, 3
WORDS = [f"w{i}" for i in range(VOCAB - 2)]


def tokenizer():
    """A word-level tokenizer over ``w0 .. w61`` plus pad and eos (built here, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*WORDS, "<pad>", "</s>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="<pad>", eos_token="</s>")


def tiny_llama():
    """Built outside zero.Init (no DeepSpeed config alive yet), so every run starts from the same
    weights: the single-process references, and stage 0 and 3."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=VOCAB - 2, eos_token_id=VOCAB - 1,
                      bos_token_id=None)
    return AutoModelForCausalLM.from_config(cfg)


def _words(g: torch.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


def sft_data():
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    return Dataset.from_dict({"text": [_words(g, 10) for _ in range(16)]})


def dpo_data():
    from datasets import Dataset

    g = torch.Generator().manual_seed(2)
    rows = [(_words(g, 4), _words(g, 3), _words(g, 3)) for _ in range(16)]
    return Dataset.from_dict({"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows],
                              "rejected": [r[2] for r in rows]})


def grpo_data():
    from datasets import Dataset

    g = torch.Generator().manual_seed(3)
    return Dataset.from_dict({"prompt": [_words(g, 4) for _ in range(16)]})


def reward_w7(completions: list[str], **_: object) -> list[float]:
    """A tiny reward: how often the completion says ``w7``."""
    return [float(c.split().count("w7")) for c in completions]


def ds_config(stage: int) -> dict:
    """As users write it for TRL: "auto" wherever the trainer's arguments decide."""
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
            "bf16": {"enabled": "auto"}}


def common(out: Path, batch: int, deepspeed: dict | None, gas: int = 1) -> dict:
    return {"output_dir": str(out), "per_device_train_batch_size": batch, "max_steps": STEPS,
            "gradient_accumulation_steps": gas,
            "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "report_to": [], "seed": 0,
            "deepspeed": deepspeed, "dataloader_drop_last": True, "disable_tqdm": True, "bf16": False,
            "accelerator_config": {"use_configured_state": deepspeed is not None}}


def sft(out: Path, batch: int, deepspeed: dict | None, gas: int = 1):
    from trl import SFTConfig, SFTTrainer

    model = tiny_llama()
    args = SFTConfig(**common(out, batch, deepspeed, gas), max_length=16, packing=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=sft_data(), processing_class=tokenizer())
    trainer.train()
    return trainer


def dpo(out: Path, batch: int, deepspeed: dict | None, gas: int = 1):
    """With a reference model: at ZeRO-3 TRL shards it itself (prepare_deepspeed ->
    deepspeed.initialize, with its dotted zero_optimization.* keys)."""
    from trl import DPOConfig, DPOTrainer

    model, ref = tiny_llama(), tiny_llama()
    args = DPOConfig(**common(out, batch, deepspeed, gas), max_length=16)
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=dpo_data(),
                         processing_class=tokenizer())
    trainer.train()
    return trainer


def grpo(out: Path, deepspeed: dict, base: Path):
    """From a model folder (TRL loads the reference model from it for the KL term, beta > 0, and
    at ZeRO-3 shards it through prepare_deepspeed; the policy is loaded under zero.Init)."""
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(**common(out, 2, deepspeed), num_generations=2, max_completion_length=4, beta=0.04)
    trainer = GRPOTrainer(model=str(base), reward_funcs=reward_w7, args=args, train_dataset=grpo_data(),
                          processing_class=tokenizer())
    trainer.train()
    return trainer


def save_base(base: Path) -> None:
    """The starting model as a folder, written by rank 0 (a collective barrier after)."""
    if int(os.environ.get("RANK", "0")) == 0:
        tiny_llama().save_pretrained(str(base))
    torch.distributed.barrier()


def weights(model) -> dict[str, list[float]]:
    """Every trained weight, gathered (the test compares runs on them; the model is tiny)."""
    from contextlib import nullcontext

    params = dict(model.named_parameters())
    if "deepspeed" in sys.modules and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(list(params.values()))
    else:
        ctx = nullcontext()
    with ctx:
        return {n: p.detach().flatten().tolist() for n, p in params.items()}


def save_and_check(trainer, folder: Path) -> float | None:
    trainer.save_model(str(folder))
    return saved_vs_live(trainer.model, folder / "model.safetensors")


def main() -> None:
    import deepspeed

    assert deepspeed.__version__.endswith("+shardwise"), deepspeed
    main_at(Path(sys.argv[1]), sys.argv[2:] or ["sft", "dpo", "grpo"])


def main_at(root: Path, parts: list[str]) -> None:
    """The trainings of ``parts`` into ``root`` (also run by tests/facade_launch.py's shared launch)."""
    root.mkdir(parents=True, exist_ok=True)
    res: dict = {}
    if "sft" in parts:
        cpu_state()
        t = sft(root / "sft", 2, ds_config(3))
        res["sft"] = {"losses": losses(t), "weights": weights(t.model),
                      "saved_vs_live": save_and_check(t, root / "sft_model")}
    if "dpo" in parts:
        cpu_state()
        t = dpo(root / "dpo", 2, ds_config(3))
        res["dpo"] = {"losses": losses(t), "weights": weights(t.model),
                      "saved_vs_live": save_and_check(t, root / "dpo_model")}
    if "grpo" in parts:
        for stage in (0, 3):  # sampling: the same ranks' draws make stage 0 and 3 comparable
            cpu_state()
            if stage == 0:
                save_base(root / "grpo_base")
            t = grpo(root / f"grpo{stage}", ds_config(stage), root / "grpo_base")
            res[f"grpo{stage}"] = {"losses": losses(t), "weights": weights(t.model)}
            if stage == 3:
                res["grpo3"]["saved_vs_live"] = save_and_check(t, root / "grpo_model")
    if int(os.environ.get("RANK", "0")) == 0:
        (root / "results.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
