"""Model-state bytes per device: the ZeRO paper's, and shardwise's own beside it.

The paper's figures (16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N in mixed precision; arXiv 1910.02054,
section 5) are :func:`model_state_bytes`, what the estimator's stage table, the planner and the
long-context budget count. shardwise holds less in one case: at stage 3 with an fp32 master on the
device (bf16/fp16 without offload) the master is the parameters' persistent copy and a gather casts it
into the all-gather (``zero/store.py``, ``MasterStore``), so no 16-bit parameter shard sits beside it
(:func:`resident_state_bytes`). Split from ``estimate/memory.py`` (the estimate as a whole).
"""

from __future__ import annotations

from typing import Any


def components(dtype: str, offload: str, master: str = "fp32", kahan: bool = True) -> list[tuple[str, int, int, bool]]:
    """(name, bytes per param, first sharded stage, offloaded to host) for the chosen precision. ``master``
    (docs/precision.md): "fp32", "master" (``*_master_weights_and_grads``: the 16-bit parameter shard is the
    master, fp32 moments) or "states" (+ ``bf16_optimizer_states``); ``kahan``: its 16-bit compensation."""
    opt_host, param_host = offload in ("optimizer", "params"), offload == "params"
    if dtype == "fp32":
        return [("fp32 params", 4, 3, param_host), ("fp32 grads", 4, 2, False),
                ("Adam m (fp32)", 4, 1, opt_host), ("Adam v (fp32)", 4, 1, opt_host)]
    if master == "fp32":
        return [(f"{dtype} params", 2, 3, param_host), ("fp32 master params", 4, 1, opt_host),
                (f"{dtype} grads", 2, 2, False), ("Adam m (fp32)", 4, 1, opt_host),
                ("Adam v (fp32)", 4, 1, opt_host)]
    k, sd = (2, dtype) if master == "states" else (4, "fp32")
    out = [(f"{dtype} params, stepped in place", 2, 3, param_host), (f"{dtype} grads", 2, 2, False),
           (f"Adam m ({sd})", k, 1, opt_host), (f"Adam v ({sd})", k, 1, opt_host)]
    if opt_host:  # the optimizer steps a host copy of the 16-bit shard
        out.insert(1, (f"{dtype} master copy (host)", 2, 1, True))
    if kahan:
        out.append((f"Kahan compensation ({dtype})", 2, 1, opt_host))
    return out


def effective_offload(stage: int, offload: str) -> str:
    """Offload needs ZeRO (stage >= 1); parameter offload needs stage 3, else only the optimizer moves."""
    if stage == 0:
        return "none"
    return "optimizer" if offload == "params" and stage < 3 else offload


def _formula(rep: int, shard: int) -> str:
    parts = ([f"{rep}Ψ"] if rep else []) + ([f"{shard}Ψ/N"] if shard else [])
    return " + ".join(parts) or "0"


def model_state_bytes(psi: int, n: int, dtype: str, stage: int, offload: str, master: str = "fp32",
                      kahan: bool = True) -> tuple[int, int, str, str]:
    """Device bytes, host bytes and their formulas for one rank; shards are padded (ceil) like chunk."""
    coef = {False: [0, 0], True: [0, 0]}  # on_host -> [replicated, sharded] bytes per parameter
    for _name, k, from_stage, host in components(dtype, effective_offload(stage, offload), master, kahan):
        coef[host][stage >= from_stage] += k
    dev, host = ((r * psi + sh * -(-psi // n)) for r, sh in (coef[False], coef[True]))
    return dev, host, _formula(*coef[False]), _formula(*coef[True])


def master_is_the_store(dtype: str, stage: int, offload: str, master: str) -> bool:
    """Does shardwise keep no 16-bit parameter shard beside an fp32 master here?"""
    return stage == 3 and offload == "none" and dtype != "fp32" and master == "fp32"


def resident_state_bytes(paper_bytes: int, paper_formula: str, psi: int, n: int, dtype: str, stage: int,
                         offload: str, master: str) -> tuple[int, str]:
    """Device bytes of model states shardwise holds during a step, and their formula: the paper's
    ``paper_bytes`` (every term sharded at stage 3) less the 16-bit parameter shard where
    :func:`master_is_the_store`."""
    if not master_is_the_store(dtype, stage, offload, master):
        return paper_bytes, paper_formula
    shard = -(-psi // n)
    return paper_bytes - 2 * shard, _formula(0, paper_bytes // shard - 2)


def resident_note(stage3: Any) -> list[str]:
    """The estimate's note when shardwise's stage-3 figure (a ``StageEstimate``) is below the paper's."""
    if stage3.resident_bytes == stage3.per_device_bytes:
        return []
    return [f"Stage 3 in shardwise: {stage3.resident_formula} = {stage3.resident_bytes / 1e9:,.2f} GB per device, "
            f"below the paper's {stage3.formula}: its fp32 master on the device is the parameters' persistent copy "
            "(no 16-bit shard beside it; a gather casts the master)."]
