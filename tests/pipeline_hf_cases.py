"""Cases for tests/test_pipeline_hf.py: a Hugging Face Llama built under ``shardwise.pipeline.stage_init()``
(each rank materializes its own stage's parameters only), trained by stages, then decoded through the stages
with ``engine.generate``. The whole-model references (``tiny_lm``, HF ``generate``) are computed by the test."""

from __future__ import annotations

import torch
from pipeline_script_cases import LM_CONFIG, lm_data, tiny_lm

PROMPT_SEED, SAMPLE_SEED, NEW_TOKENS = 7, 11, 6


def prompt() -> torch.Tensor:
    return torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(PROMPT_SEED))


def build(tied: bool, folder: str | None):
    """The model under stage_init: from the config (seeded as ``tiny_lm``) or read from ``folder``."""
    from transformers import AutoModelForCausalLM

    import shardwise

    with shardwise.pipeline.stage_init():
        if folder is None:
            model = tiny_lm(tied)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder)
            model.config._attn_implementation = "eager"
    return model


def _real_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params if not p.is_meta)


def stage_build_train_generate(tied: bool, folder: str | None = None, virtual: int = 1) -> dict:
    """This rank's stage: the bytes made real (in the whole model and in the stage), the stage's parameters
    under HF names before and after two steps, and greedy and sampled tokens decoded through the stages.
    ``virtual`` > 1: the split cut into 2 x virtual chunks, trained by interleaved 1F1B."""
    import shardwise

    model = build(tied, folder)
    metas_before = sum(p.is_meta for p in model.parameters())
    pipe = {"stages": 2} if virtual == 1 else {"stages": 2, "schedule": "interleaved_1f1b", "virtual_stages": virtual}
    engine, *_ = shardwise.initialize(model=model, config={**LM_CONFIG, "pipeline": pipe})
    names = engine.module.hf_names
    own = list({id(p): p for p in engine.module.parameters()}.values())
    out = {"stage": engine.stage_id, "metas_before": metas_before, "whole_real": _real_bytes(model.parameters()),
           "stage_bytes": _real_bytes(own), "made": engine.module.materialized_bytes,
           "read": getattr(engine.module, "bytes_read", None),
           "initial": {names[n]: p.detach().clone() for n, p in engine.module.named_parameters() if n in names}}
    for s in range(2):
        engine.train_batch(iter(lm_data(s, 0, 2)))
    out["trained"] = {names[n]: p.detach().clone() for n, p in engine.module.named_parameters() if n in names}
    ids = prompt()
    sent = engine.comm_stats().get("send", 0)
    out["greedy"] = engine.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    do_sample=False)
    out["greedy_sent"] = engine.comm_stats().get("send", 0) - sent
    torch.manual_seed(SAMPLE_SEED)
    out["sampled"] = engine.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=10,
                                     temperature=0.8)
    try:
        model(input_ids=ids)
    except Exception as e:  # noqa: BLE001 - the refusal's line is the answer
        out["whole_call"] = f"{type(e).__name__}: {e}"
    try:
        engine.generate(input_ids=ids, num_beams=2)
    except Exception as e:  # noqa: BLE001 - the refusal's line is the answer
        out["beams"] = f"{type(e).__name__}: {e}"
    return out


def failing_decode() -> tuple[str, float]:
    """Stage 0's layers raise at the decode's second step: this rank's line and how long it took to end."""
    import time

    import shardwise
    from shardwise.pipeline import hf

    engine, *_ = shardwise.initialize(model=tiny_lm(False), config={**LM_CONFIG, "pipeline": {"stages": 2}})
    decode = hf.DecoderLayer.decode

    def broken(self, hidden, past, cache):
        if past > 0 and engine.stage_id == 0:
            raise RuntimeError("a layer failed at the second step")
        return decode(self, hidden, past, cache)

    hf.DecoderLayer.decode = broken
    start = time.monotonic()
    try:
        engine.generate(input_ids=prompt(), max_new_tokens=4)
    except Exception as e:  # noqa: BLE001 - the line is the answer
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    finally:
        hf.DecoderLayer.decode = decode
    return "none", time.monotonic() - start
