"""Memory and communication estimator for ZeRO stages 0-3, offload and tensor parallelism.

Answers "which configuration fits, and what does it cost" before any GPU is touched. Formulas
follow the ZeRO paper (arXiv 1910.02054, sections 5 and 7), Megatron TP (arXiv 1909.08053) and
activation memory from arXiv 2205.05198. Units: GB = 1e9 bytes, GiB = 2**30 bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from shardwise.estimate.states import (
    components,
    effective_offload,
    model_state_bytes,
    resident_note,
    resident_state_bytes,
)

Dtype = Literal["fp32", "bf16", "fp16"]
Offload = Literal["none", "optimizer", "params"]
MARGIN = 0.10  # share of device memory kept free for the CUDA context, allocator slack, buffers

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "KIB": 2**10, "M": 10**6, "MB": 10**6,
               "MIB": 2**20, "G": 10**9, "GB": 10**9, "GIB": 2**30, "T": 10**12, "TB": 10**12,
               "TIB": 2**40}
_STAGE_SHARDED = {0: "nothing (DDP)", 1: "optimizer states (fp32 master, m, v)",
                  2: "+ gradients", 3: "+ parameters"}
_COLLECTIVES = {0: "all-reduce grads", 1: "reduce-scatter grads + all-gather params",
                2: "reduce-scatter grads + all-gather params",
                3: "all-gather fwd + all-gather bwd + reduce-scatter grads"}


def _parse_scaled(text: str, units: dict[str, int], what: str) -> int:
    """Shared parser: a decimal number, optional exponent, optional unit; exact, no float rounding."""
    m = re.fullmatch(r"\s*([0-9][0-9_,]*(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else ""
    if not m or unit not in units:
        examples = "7.5B, 350M, 1e9, 1,000" if what == "count" else "80GB, 80GiB, 24G"
        raise ValueError(f"not a {what}: {text!r} (examples: {examples})")
    try:
        value = Decimal(m.group(1).replace(",", "").replace("_", "")) * units[unit]
    except InvalidOperation as exc:
        raise ValueError(f"not a {what}: {text!r}") from exc
    if value != value.to_integral_value():
        raise ValueError(f"not a whole {what}: {text!r}")
    return int(value)


def parse_count(text: str | int) -> int:
    """Parse '7.5B', '350M', '1T', '1e9', '1,000' into an int (K/M/B/T are powers of 1000)."""
    return text if isinstance(text, int) else _parse_scaled(text, _COUNT_SUFFIX, "count")


def parse_bytes(text: str | int) -> int:
    """Parse '80GB' (1e9), '80GiB' (2**30), '24G' (same as GB) into bytes; case-insensitive."""
    return text if isinstance(text, int) else _parse_scaled(text, _BYTE_UNITS, "byte size")


@dataclass(frozen=True)
class ModelFacts:
    """Shape facts the activation, TP and fit estimates need beyond the raw parameter count."""

    params: int
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    intermediate_size: int | None
    largest_layer_params: int  # biggest transformer block or stand-alone module (e.g. embedding)
    largest_layer_name: str


def _load_config(src: Any) -> Any:
    """Accept a PretrainedConfig, a model directory or a config.json path; never touch the network."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(src, PretrainedConfig):
        return src
    path = os.fspath(src)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"no model config at {os.fspath(src)!r}: expected a directory with config.json "
                         "or a config.json file")
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if "model_type" not in data:
        raise ValueError(f"{path}: config has no 'model_type'")
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)


def model_facts(src: Any) -> ModelFacts:
    """Build the HF model on the meta device (no memory, no weights) and read its exact shape."""
    import torch
    from torch import nn
    from transformers import AutoModel, AutoModelForCausalLM

    cfg = _load_config(src)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(cfg)
        except ValueError:  # not a causal LM (e.g. an encoder): the base model still counts
            model = AutoModel.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    text = cfg.get_text_config()  # multimodal configs keep the LM shape in a sub-config
    layers = getattr(text, "num_hidden_layers", 0)
    blocks = max((m for m in model.modules() if isinstance(m, nn.ModuleList)),
                 key=lambda m: (len(m) == layers, len(m)), default=None)
    largest, name = 0, ""
    in_blocks: set[int] = set()
    for i, block in enumerate(blocks or []):
        ids = {id(p): p.numel() for p in block.parameters()}
        in_blocks.update(ids)
        if sum(ids.values()) > largest:
            largest, name = sum(ids.values()), f"block {i}"
    for mod_name, mod in model.named_modules():  # embeddings, head, final norm: gathered whole too
        own = {id(p): p.numel() for p in mod.parameters(recurse=False) if id(p) not in in_blocks}
        if own and sum(own.values()) > largest:
            largest, name = sum(own.values()), mod_name
    heads = getattr(text, "num_attention_heads", 0) or 0
    ffn = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None)
    if ffn is None and cfg.model_type == "gpt2":
        ffn = 4 * text.hidden_size
    return ModelFacts(params=total, model_type=cfg.model_type, hidden_size=text.hidden_size,
                      num_layers=layers, num_heads=heads, vocab_size=text.vocab_size,
                      num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                      intermediate_size=ffn, largest_layer_params=largest, largest_layer_name=name)


def count_params(src: Any) -> int:
    """Exact unique parameter count of a HF model from its config (see `model_facts`)."""
    return model_facts(src).params


@dataclass
class Component:
    """One piece of the model states: full size per replica and the stage from which it is sharded."""

    name: str
    formula: str
    bytes: int
    sharded_from_stage: int
    on_host: bool = False


@dataclass
class StageEstimate:
    """Per-rank memory and data-parallel communication of one ZeRO stage."""

    stage: int
    sharded: str
    offload: str
    formula: str
    host_formula: str
    per_device_bytes: int
    host_bytes: int
    cluster_bytes: int
    cluster_host_bytes: int
    saving: float
    comm_collectives: str
    comm_elements: int
    comm_bytes: int
    pcie_bytes: int
    resident_bytes: int = 0  # shardwise's own device figure (estimate/states.py), the paper's but at stage 3
    resident_formula: str = ""
    nvme_bytes: int = 0  # --offload nvme: the host bytes of optimizer offload, in swap files (estimate/nvme.py)


@dataclass
class Candidate:
    """One (stage, offload, tp) option checked against the device memory."""

    stage: int
    offload: str
    tp: int
    device_need_bytes: int
    host_bytes: int
    fits: bool


@dataclass
class Estimate:
    """Everything `format_report` prints and `--json` emits."""

    params: int
    devices: int
    tp: int
    dp: int
    dtype: str
    offload: str
    psi: int  # parameters per tensor-parallel rank
    components: list[Component]
    stages: dict[int, StageEstimate]
    tp_comm_bytes: int | None = None
    activations: dict[str, Any] | None = None
    device_memory: int | None = None
    margin: float = MARGIN
    candidates: list[Candidate] = field(default_factory=list)
    recommendation: dict[str, Any] | None = None
    facts: ModelFacts | None = None
    notes: list[str] = field(default_factory=list)
    master: str = "fp32"  # "fp32", "master" or "states" (see states.components)
    kahan: bool = True

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; stage keys become "0".."3" as JSON requires string keys."""
        out = dataclasses.asdict(self)
        out["stages"] = {str(k): v for k, v in out["stages"].items()}
        return out


def _activations(facts: ModelFacts, micro_batch: int, seq: int, tp: int, dtype: str,
                 checkpointing: bool) -> dict[str, Any]:
    """arXiv 2205.05198: s·b·h·(34 + 5·a·s/h) bytes per layer (16-bit), /t with sequence parallel."""
    s, b, h, a, L = seq, micro_batch, facts.hidden_size, facts.num_heads, facts.num_layers
    scale = 2 if dtype == "fp32" else 1  # the formula counts 16-bit tensors; fp32 roughly doubles it
    per_layer = -(-s * b * (34 * h + 5 * a * s) // tp) * scale
    layers = L * -(-2 * s * b * h // tp) * scale + per_layer if checkpointing else L * per_layer
    formula = "L·2·s·b·h/t + s·b·h·(34 + 5·a·s/h)/t" if checkpointing else "L·s·b·h·(34 + 5·a·s/h)/t"
    logits = -(-4 * s * b * facts.vocab_size // tp)  # HF computes the loss on fp32 logits
    return {"per_layer_bytes": per_layer, "layers_bytes": layers, "layers_formula": formula,
            "logits_bytes": logits, "total_bytes": layers + logits, "checkpointing": checkpointing,
            "micro_batch": b, "seq": s}


def working_bytes(facts: ModelFacts | None, tp: int, dtype: str, micro_batch: int | None, seq: int | None,
                  ckpt: bool, stage: int) -> int:
    """Bytes beyond the model states: activations, and at stage 3 one gathered layer's params + grads."""
    extra = 0
    if facts and micro_batch and seq:
        extra += _activations(facts, micro_batch, seq, tp, dtype, ckpt)["total_bytes"]
    if stage == 3 and facts:
        extra += -(-facts.largest_layer_params // tp) * (8 if dtype == "fp32" else 4)
    return extra


def estimate(params: int, devices: int, tp: int = 1, dtype: Dtype = "bf16", offload: Offload = "none",
             micro_batch: int | None = None, seq: int | None = None, facts: ModelFacts | None = None,
             activation_checkpointing: bool = False, device_memory: int | None = None, master: str = "fp32",
             kahan: bool = True) -> Estimate:
    """Per-component, per-stage memory, communication, activations and a fit recommendation
    (``master``, ``kahan``: the master precision mode, see :func:`_components`)."""
    if params <= 0 or devices <= 0 or tp <= 0:
        raise ValueError("params, devices and tp must be positive")
    if devices % tp:
        raise ValueError(f"devices ({devices}) must be divisible by tp ({tp})")
    if dtype not in ("fp32", "bf16", "fp16") or offload not in ("none", "optimizer", "params"):
        raise ValueError(f"bad dtype {dtype!r} or offload {offload!r}")
    if dtype not in {"fp32": ("fp32", "bf16", "fp16"), "master": ("bf16", "fp16"), "states": ("bf16",)}.get(master, ()):
        raise ValueError(f"master mode {master!r} does not apply to {dtype} (bf16: master, states; fp16: master)")
    n, psi = devices // tp, -(-params // tp)
    el = 4 if dtype == "fp32" else 2
    comps = [Component(name, f"{k}Ψ", k * psi, s, host)
             for name, k, s, host in components(dtype, offload, master, kahan)]
    base = model_state_bytes(psi, n, dtype, 0, "none", master, kahan)[0]
    stages: dict[int, StageEstimate] = {}
    for st in range(4):
        off = effective_offload(st, offload)
        dev, host, f_dev, f_host = model_state_bytes(psi, n, dtype, st, offload, master, kahan)
        resident, f_resident = resident_state_bytes(dev, f_dev, psi, n, dtype, st, offload, master)
        elems = (3 if st == 3 else 2) * psi
        # host<->device per step: grad shard down, param shard up (+ fwd and bwd fetch with "params")
        pcie = 0 if off == "none" else (2 + 2 * (off == "params")) * -(-psi // n) * el
        stages[st] = StageEstimate(
            stage=st, sharded=_STAGE_SHARDED[st], offload=off, formula=f_dev, host_formula=f_host,
            per_device_bytes=dev, host_bytes=host, cluster_bytes=dev * devices,
            cluster_host_bytes=host * devices, saving=1 - dev / base,
            comm_collectives=_COLLECTIVES[st], comm_elements=elems,
            comm_bytes=elems * (n - 1) // n * el, pcie_bytes=pcie, resident_bytes=resident,
            resident_formula=f_resident)
    est = Estimate(params=params, devices=devices, tp=tp, dp=n, dtype=dtype, offload=offload, psi=psi,
                   components=comps, stages=stages, device_memory=device_memory, facts=facts,
                   master=master, kahan=kahan)
    est.notes += resident_note(stages[3])
    if tp > 1:
        est.notes.append(f"TP: every parameter is treated as split {tp} ways (Ψ = params/tp); norms and "
                         "biases are in fact replicated, so this slightly underestimates.")
    if offload != "none":
        est.notes.append("Offload: stage 0 cannot offload; parameter offload applies to stage 3 only "
                         "(stages 1-2 offload the optimizer). Host bytes are per rank.")
    if facts and micro_batch and seq:
        est.activations = _activations(facts, micro_batch, seq, tp, dtype, activation_checkpointing)
        if tp > 1:  # 2 all-reduces fwd + 2 bwd per layer (+2 for recompute), ring: 2(t-1)/t of b·s·h
            per_layer = (6 if activation_checkpointing else 4) * micro_batch * seq * facts.hidden_size
            est.tp_comm_bytes = facts.num_layers * per_layer * el * 2 * (tp - 1) // tp
    if device_memory and not facts:
        est.notes.append("Fit without --model counts model states only: no activations and no gathered "
                         "stage-3 layer.")
    if device_memory:
        _recommend(est, micro_batch, seq, activation_checkpointing)
    return est


_OPTIONS = [(0, "none"), (1, "none"), (2, "none"), (3, "none"),
            (1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "params")]


def _recommend(est: Estimate, mb: int | None, seq: int | None, ckpt: bool) -> None:
    """Least communication that fits: stages 0→3, then more TP if one layer is too big, then offload."""
    budget = int(est.device_memory * (1 - est.margin))

    def check(tp: int) -> list[Candidate]:  # peak need = model states + activations + gathered layer
        out = []
        for st, off in _OPTIONS:
            dev, host, _, _ = model_state_bytes(-(-est.params // tp), est.devices // tp, est.dtype, st, off,
                                                est.master, est.kahan)
            dev += working_bytes(est.facts, tp, est.dtype, mb, seq, ckpt, st)
            out.append(Candidate(st, off, tp, dev, host, dev <= budget))
        return out

    est.candidates = check(est.tp)
    gb = budget / 1e9

    def pick(c: Candidate, reason: str) -> None:
        est.recommendation = {"stage": c.stage, "offload": c.offload, "tp": c.tp, "fits": c.fits,
                              "device_need_bytes": c.device_need_bytes, "host_bytes": c.host_bytes,
                              "reason": reason}

    plain = [c for c in est.candidates if c.offload == "none"]
    for c in plain:
        if c.fits:
            use = f"{c.device_need_bytes / 1e9:.1f} of {gb:.1f} GB usable"
            prev = "" if c.stage == 0 else \
                f"; stage {c.stage - 1} needs {plain[c.stage - 1].device_need_bytes / 1e9:.1f} GB"
            cost = ("it moves 1.5x the data of stages 0-2 (3Ψ vs 2Ψ per step)" if c.stage == 3 else
                    "it communicates no more than plain DDP (2Ψ per step)")
            pick(c, f"Stage {c.stage} is the first stage that fits ({use}{prev}) and {cost}.")
            return
    facts = est.facts
    if facts:
        layer_only = working_bytes(facts, est.tp, est.dtype, mb, seq, ckpt, stage=3)
        if layer_only > budget:  # no amount of sharding or offload helps: split the layers
            for t in (t for t in range(est.tp + 1, est.devices + 1) if est.devices % t == 0
                      and (not facts.num_heads or facts.num_heads % t == 0)):
                for c in check(t):
                    if c.fits:  # plain stages come first in check(), offload after
                        est.candidates.append(c)
                        off = "" if c.offload == "none" else f" with {c.offload} offload"
                        hint = "" if ckpt or not (mb and seq) else " (activation checkpointing also helps)"
                        pick(c, f"The largest layer ({facts.largest_layer_name}, "
                                f"{facts.largest_layer_params:,} params) gathered plus activations need "
                                f"{layer_only / 1e9:.1f} GB, more than {gb:.1f} GB usable, so split layers "
                                f"with tp={t}; then stage {c.stage}{off} fits{hint}.")
                        return
    for c in est.candidates:
        if c.fits:
            pick(c, f"No stage fits without offload (stage 3 needs {plain[3].device_need_bytes / 1e9:.1f} GB "
                    f"of {gb:.1f} GB usable); stage {c.stage} with {c.offload} offload fits "
                    f"({c.device_need_bytes / 1e9:.1f} GB on device, {c.host_bytes / 1e9:.1f} GB host per "
                    "rank) at the cost of PCIe traffic each step.")
            return
    best = min(est.candidates, key=lambda c: c.device_need_bytes)
    pick(best, f"Nothing fits: the smallest need is {best.device_need_bytes / 1e9:.1f} GB per device "
               f"(stage {best.stage}, {best.offload} offload) vs {gb:.1f} GB usable; add devices, enable "
               "activation checkpointing or lower the micro batch.")

