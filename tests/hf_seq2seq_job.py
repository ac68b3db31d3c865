"""Stock Hugging Face code at ZeRO-3 that calls submodules on their own or resizes embeddings, run
under ``shardwise launch --as-deepspeed`` (tests/test_hf_seq2seq.py).

* ``Seq2SeqTrainer(predict_with_generate=True).predict`` on a tiny T5: ``generate`` runs
  ``model.get_encoder()(input_ids)`` directly (before shardwise.zero.stage3.direct_calls: NaN encoder
  output, every prediction pad tokens);
* ``model.resize_token_embeddings(n)`` after ``from_pretrained`` under ``HfDeepSpeedConfig`` at
  stage 3 (transformers passes ``GatheredParameters`` lists with ``None`` biases), then
  ``deepspeed.initialize`` and a forward on the new tokens.

Rank 0 writes ``results.pt`` into the folder given as the first argument, which holds the saved
:func:`tiny_llama` in ``llama/``. Also importable: the
pytest process builds the same models and data for the single-process references.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

VOCAB, NEW_VOCAB, SAMPLES, SRC_LEN, TGT_LEN, GEN_LEN = 64, 77, 8, 8, 5, 6
SUPPRESS = [0, 1]  # pad (the decoder start) and eos: every prediction is GEN_LEN real tokens


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(cfg)
    model.generation_config.suppress_tokens = SUPPRESS
    return model


def seq2seq_data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(2, VOCAB, (SAMPLES, SRC_LEN), generator=g)
    tgt = torch.randint(2, VOCAB, (SAMPLES, TGT_LEN), generator=g)
    return [{"input_ids": s, "attention_mask": torch.ones_like(s), "labels": t} for s, t in zip(src, tgt, strict=True)]


def seq2seq_args(out: Path, deepspeed: dict | None):
    from transformers import Seq2SeqTrainingArguments

    return Seq2SeqTrainingArguments(output_dir=str(out), per_device_eval_batch_size=2, predict_with_generate=True,
                                    generation_max_length=GEN_LEN + 1, generation_num_beams=1, report_to=[],
                                    seed=0, deepspeed=deepspeed, disable_tqdm=True,
                                    accelerator_config={"use_configured_state": deepspeed is not None})


def predict(out: Path, deepspeed: dict | None) -> dict:
    """The predictions (rows in dataset order, -100 padding dropped) and the eval loss."""
    from transformers import Seq2SeqTrainer

    args = seq2seq_args(out, deepspeed)  # args first: the model is then built under zero.Init
    trainer = Seq2SeqTrainer(model=tiny_t5(), args=args)
    res = trainer.predict(seq2seq_data())
    preds = [[int(t) for t in row if t != -100] for row in res.predictions]
    return {"predictions": preds, "loss": float(res.metrics["test_loss"])}


def tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg)


def resize(model, seed: int = 5):
    """transformers' resize to NEW_VOCAB, its defaults (the added rows sampled around the old mean)."""
    torch.manual_seed(seed)
    model.resize_token_embeddings(NEW_VOCAB)
    return model


def new_token_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(VOCAB, NEW_VOCAB, (2, 10), generator=g)  # only tokens the resize added


def resize_case(folder: Path) -> dict:
    """``from_pretrained`` under HfDeepSpeedConfig (stage 3: loaded under zero.Init), resize, then
    shard and run. The folder holds :func:`tiny_llama` (saved by the test), so the plain reference
    starts from the same weights."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    cfg = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    keep = HfDeepSpeedConfig(cfg)  # noqa: F841 (transformers reads it through a weak reference)
    model = resize(AutoModelForCausalLM.from_pretrained(folder))
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    ids = new_token_batch()
    with torch.no_grad():
        loss = float(engine(input_ids=ids, labels=ids).loss)
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        weights = {n: p.detach().clone() for n, p in params.items()}
    return {"loss": loss, "weights": weights, "config_vocab": engine.module.config.vocab_size}


def main() -> None:
    import deepspeed

    assert deepspeed.__version__.endswith("+shardwise"), deepspeed
    main_at(Path(sys.argv[1]))


def main_at(root: Path) -> None:
    """Both cases into ``root``, which holds the saved :func:`tiny_llama` in ``llama/`` (also run by
    tests/facade_launch.py's shared launch)."""
    from hf_facade_job import cpu_state

    cpu_state()
    res = {"predict": predict(root / "s2s", {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                                             "zero_optimization": {"stage": 3,
                                                                   "stage3_param_persistence_threshold": 0}}),
           "resize": resize_case(root / "llama")}
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(res, root / "results.pt")


if __name__ == "__main__":
    main()
