"""Two sections of ``benchmarks/gpu_check.py`` that run library paths on one GPU and compare their numbers.

``parallel``: tensor, sequence and expert parallelism at degree 1 (world 1). The engine skips
TP and SP at degree 1, so the section applies them itself, as a user would before
``initialize``: ``apply_tensor_parallel`` over the mesh's TP group of one (every linear and the
embedding become parallel layers), the Ulysses and the ring attention registered over an SP group
of one, and an MoE model's experts split one way through the ``expert_parallel`` config (the
router, dispatch, registered experts and combine run). How far degree 1 reaches: the wrappers and
layers run on the GPU, but each collective is skipped at size 1 (TP's identity copies, SP's
attention inactive, EP's exchange a local copy); the collectives themselves need two ranks, which
one GPU cannot give NCCL. Each trains 3 fp32 steps against plain torch on the same model and
batches, held to the stages' bound (a multiple of torch's own AdamW spread on that model).

``checkpoint``: an engine at stages 2 and 3 saves after 2 steps; a fresh engine (other initial
weights) loads it and both take a third step: the loaded weights and the third step's weights must
be bit-equal to the saver's (the optimizer state came back too); ``consolidate`` of the checkpoint
(an HF folder, host-only) must hold the saver's fp32 weights bit for bit.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import torch
from gpu.common import (
    STAGE_MODEL,
    TINY,
    batches,
    cuda,
    engine_run,
    host_weights,
    join_world_of_one,
    max_abs_diff,
    save_partial,
    skip,
    torch_spread,
)
from shared.models import engine_config, llama

SPREAD_MULTIPLE = 2.0  # as in the stages section (gpu/sections.py says why)
MOE_SHAPE = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4, "vocab_size": 512, "num_local_experts": 4, "num_experts_per_tok": 2}


def _mixtral(shape: dict, experts: str | None = None) -> torch.nn.Module:
    """A small Mixtral; ``experts``: transformers' experts kernel to use instead of its default."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(max_position_embeddings=2048, tie_word_embeddings=False, attn_implementation="sdpa",
                        output_router_logits=False, **shape)
    model = MixtralForCausalLM(cfg)
    if experts is not None:
        model.config._experts_implementation = experts
    return model


def _with_tp(shape: dict) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        from shardwise.layout import get_mesh
        from shardwise.tensor_parallel import apply_tensor_parallel

        model = llama(shape)
        apply_tensor_parallel(model, get_mesh(1).tp)
        return model
    return make


def _with_sp(shape: dict, attention: str) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        from shardwise.sequence_parallel import SequenceParallel, register_attention

        model = llama(shape)
        register_attention(model, SequenceParallel.of_size(1, 1), attention)
        return model
    return make


def _case(name: str, make: Callable[[], torch.nn.Module], plain: Callable[[], torch.nn.Module], config: dict,
          ids: torch.Tensor) -> dict:
    # EP sums each token's experts in another order than transformers' default experts kernel: torch's
    # own other experts kernel (eager) is part of the spread there, as in tests/test_moe.py
    others = {"experts_eager": lambda: _mixtral(MOE_SHAPE, "eager")} if name.startswith("ep") else None
    ref = torch_spread(plain, ids, others)
    run = engine_run(make, config, ids)
    diff = max_abs_diff(run["weights"], ref["ref_weights"])
    bound = SPREAD_MULTIPLE * ref["spread"]
    return {"path": name, "device": str(ids.device), "loss": run["loss"], "ref_loss": ref["ref_loss"],
            "max_abs_weight_diff": diff, "torch_spread": ref["spread"], "bound": bound, "matches": diff <= bound}


def parallel(smoke: bool, workdir: str, limit_s: float) -> dict:  # noqa: ARG001
    if not cuda() and not smoke:
        return skip("no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    join_world_of_one()
    from shardwise.comm import compute_device

    device = compute_device()
    shape = TINY if smoke else STAGE_MODEL
    ids, moe_ids = batches(shape, 3, device), batches(MOE_SHAPE, 3, device)
    moe_cfg = {**engine_config(2, "fp32"), "expert_parallel": {"enabled": True, "autoep_size": 1}}
    cases = [("tp 1 (apply_tensor_parallel), ZeRO-1", _with_tp(shape), lambda: llama(shape), engine_config(1, "fp32"),
              ids),
             ("sp 1 ulysses, ZeRO-2", _with_sp(shape, "ulysses"), lambda: llama(shape), engine_config(2, "fp32"), ids),
             ("sp 1 ring, ZeRO-2", _with_sp(shape, "ring"), lambda: llama(shape), engine_config(2, "fp32"), ids),
             ("ep 1 (expert_parallel), ZeRO-2", lambda: _mixtral(MOE_SHAPE), lambda: _mixtral(MOE_SHAPE), moe_cfg,
              moe_ids)]
    rows: list[dict] = []
    for name, make, plain, cfg, batch in cases:
        try:
            rows.append(_case(name, make, plain, cfg, batch))
        except Exception as e:  # noqa: BLE001 - one failed path must not hide the others
            rows.append({"path": name, "matches": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        save_partial(rows)
    ok = all(r["matches"] for r in rows)
    return {"status": "ok" if ok else "partial", "rows": rows,
            "notes": [f"3 fp32 AdamW steps against plain torch on the same model and batches; matches when "
                      f"max_abs_weight_diff <= {SPREAD_MULTIPLE:g} x torch_spread (torch's own AdamW kernels "
                      "on that model, measured here; for EP also transformers' eager experts kernel)"]}


# -- checkpoint save / load / consolidate ---------------------------------------------------------------------
def _engine(shape: dict, stage: int, seed: int):
    import shardwise

    model = llama(shape, seed=seed)
    engine, _, _, _ = shardwise.initialize(model=model, config=engine_config(stage, "fp32"))
    return engine


def _train(engine, ids: torch.Tensor) -> None:
    for batch in ids:
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()


def _consolidated(ckpt: str, out: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from shardwise.checkpoint import consolidate

    names = consolidate(ckpt, out, dtype="fp32", weights_only=True)
    got: dict[str, torch.Tensor] = {}
    for name in names:
        got.update(load_file(os.path.join(out, name)))
    return got


def _checkpoint_case(stage: int, shape: dict, ids: torch.Tensor, workdir: str) -> dict:
    ckpt, out = os.path.join(workdir, f"ckpt_stage{stage}"), os.path.join(workdir, f"consolidated_stage{stage}")
    for folder in (ckpt, out):  # the workdir is kept between runs: never an earlier run's files
        shutil.rmtree(folder, ignore_errors=True)
    saver = _engine(shape, stage, seed=0)
    _train(saver, ids[:2])
    saver.save_checkpoint(ckpt, tag="gc")
    saved = host_weights(saver.module)
    loader = _engine(shape, stage, seed=1)  # other initial weights: only the load can make them equal
    loader.load_checkpoint(ckpt, tag="gc")
    loaded = host_weights(loader.module)
    merged = _consolidated(ckpt, out)
    _train(saver, ids[2:])
    _train(loader, ids[2:])
    after_saver, after_loader = host_weights(saver.module), host_weights(loader.module)
    load_equal = all(torch.equal(loaded[n], w) for n, w in saved.items())
    step_equal = all(torch.equal(after_loader[n], w) for n, w in after_saver.items())
    cons_equal = set(merged) == set(saved) and all(torch.equal(merged[n].float(), w) for n, w in saved.items())
    return {"stage": stage, "device": str(ids.device), "load_bit_equal": load_equal,
            "next_step_bit_equal": step_equal, "consolidate_bit_equal": cons_equal,
            "max_abs_after_next_step": max_abs_diff(after_loader, after_saver),
            "matches": load_equal and step_equal and cons_equal}


def checkpoint(smoke: bool, workdir: str, limit_s: float) -> dict:  # noqa: ARG001
    if not cuda() and not smoke:
        return skip("no CUDA device")
    join_world_of_one()
    from shardwise.comm import compute_device

    shape = TINY if smoke else STAGE_MODEL
    ids = batches(shape, 3, compute_device())
    rows: list[dict] = []
    for stage in (2, 3):
        try:
            rows.append(_checkpoint_case(stage, shape, ids, workdir))
        except Exception as e:  # noqa: BLE001 - one failed stage must not hide the other
            rows.append({"stage": stage, "matches": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        save_partial(rows)
    ok = all(r["matches"] for r in rows)
    return {"status": "ok" if ok else "partial", "rows": rows,
            "notes": ["save after 2 steps, load into an engine built from other weights, one more step on both: "
                      "bitwise equal weights after the load and after the step; consolidate's fp32 HF folder "
                      "equal to the saved weights bitwise"]}
