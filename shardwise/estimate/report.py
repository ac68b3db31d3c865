"""`shardwise estimate`: the estimator's tables as text, and its command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from shardwise.cli_errors import OneLineParser, UserError
from shardwise.estimate.memory import (
    Estimate,
    estimate,
    model_facts,
    parse_bytes,
    parse_count,
)
from shardwise.safe_files import read_in, read_regular


def _gb(b: float, unit: float = 1e9) -> str:
    return f"{b / unit:,.2f}"


def _gib(b: float) -> str:
    return _gb(b, 2**30)


def _table(headers: list[str], rows: list[list[str]], align: str) -> str:
    """Plain-text table with aligned columns; align holds 'l' or 'r' per column."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def fmt(r: list[str]) -> str:
        return "  ".join(v.ljust(w) if a == "l" else v.rjust(w)
                         for v, w, a in zip(r, widths, align, strict=True)).rstrip()

    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def format_report(est: Estimate) -> str:
    """Human-readable tables: components, stages, communication, activations, fit."""
    tp_txt = f" x {est.tp} tensor-parallel" if est.tp > 1 else ""
    out = [f"shardwise estimate: {est.params:,} params, {est.devices} devices = {est.dp} data-parallel"
           f"{tp_txt}, {est.dtype} + Adam, offload: {est.offload}"
           + ("" if est.master == "fp32" else f", {est.dtype} master ({est.master} mode"
              + (", Kahan)" if est.kahan else ")")),
           f"Units: GB = 1e9 bytes, GiB = 2^30 bytes. Ψ = params per TP rank = {est.psi:,}; N = {est.dp}."]
    for section in (_components_table, _stages_table, _comm_table, _activations_table, _fit_table):
        out += section(est)
    if est.notes:
        out.append("\nNotes:\n" + "\n".join(f"- {x}" for x in est.notes))
    return "\n".join(out)


def _components_table(est: Estimate) -> list[str]:
    rows = [[c.name, c.formula, _gb(c.bytes), _gib(c.bytes)] for c in est.components]
    total = sum(c.bytes for c in est.components)
    rows.append(["total", f"{total // est.psi}Ψ", _gb(total), _gib(total)])
    return ["\nModel states, unsharded (one replica)", _table(["component", "formula", "GB", "GiB"], rows, "llrr")]


def _stages_table(est: Estimate) -> list[str]:
    offl = est.offload != "none"
    rows = []
    for s in est.stages.values():
        row = [str(s.stage), s.sharded, s.formula, _gb(s.per_device_bytes), _gib(s.per_device_bytes),
               _gb(s.cluster_bytes), f"{s.saving:.1%}"]
        if offl:
            row[2:2] = [s.offload]
            row += [s.host_formula, _gb(s.host_bytes)]
        rows.append(row)
    heads = ["stage", "sharded", "formula", "per device GB", "GiB", "cluster GB", "saving"]
    if offl:
        heads[2:2] = ["offload"]
        heads += ["host formula", "host GB/rank"]
    return [f"\nZeRO stages, per device (cluster = per device x {est.devices} devices)",
            _table(heads, rows, "llllrrrrlr" if offl else "lllrrrr")]


def _comm_table(est: Estimate) -> list[str]:
    n, offl = est.dp, est.offload != "none"
    out = [f"\nCommunication per step per rank (data parallel; ring sends (N-1)/N = {(n - 1) / n:.3f}"
           f" of it; {4 if est.dtype == 'fp32' else 2} bytes/element)"]
    rows = [[str(s.stage), s.comm_collectives, "3Ψ" if s.stage == 3 else "2Ψ", f"{s.comm_elements:,}",
             _gb(s.comm_bytes)] + ([_gb(s.pcie_bytes)] if offl else []) for s in est.stages.values()]
    out.append(_table(["stage", "collectives", "volume", "elements", "GB sent"]
                      + (["PCIe GB"] if offl else []), rows, "llrrr" + "r" * offl))
    if est.tp_comm_bytes is not None:
        out.append(f"Tensor parallel: 2 all-reduces of b·s·h forward + 2 backward per layer"
                   f"{' (+2 recompute)' if est.activations and est.activations['checkpointing'] else ''}: "
                   f"{_gb(est.tp_comm_bytes)} GB sent per rank per micro batch.")
    return out


def _activations_table(est: Estimate) -> list[str]:
    a = est.activations
    if not a:
        return ["\nActivations per device", "not estimated (needs --model for shape, --micro-batch and --seq)"]
    return ["\nActivations per device", _table(["item", "formula", "GB", "GiB"], [
        ["per layer", "s·b·h·(34 + 5·a·s/h)/t", _gb(a["per_layer_bytes"]), _gib(a["per_layer_bytes"])],
        ["all layers" + (" (checkpointed)" if a["checkpointing"] else ""),
         a["layers_formula"], _gb(a["layers_bytes"]), _gib(a["layers_bytes"])],
        ["output logits", "4·b·s·V/t", _gb(a["logits_bytes"]), _gib(a["logits_bytes"])],
        ["total", "", _gb(a["total_bytes"]), _gib(a["total_bytes"])]], "llrr")]


def _fit_table(est: Estimate) -> list[str]:
    if not (est.device_memory and est.recommendation):
        return ["\nFit", "not checked (pass --device-memory, e.g. 80GB)"]
    usable = est.device_memory * (1 - est.margin)
    r = est.recommendation
    verb = "Recommendation" if r["fits"] else "Closest option"
    return ["\nFit",
            f"device memory {_gb(est.device_memory)} GB, {est.margin:.0%} kept as margin -> "
            f"{_gb(usable)} GB usable; need = states + activations + (stage 3) one gathered layer",
            _table(["stage", "offload", "tp", "need GB", "host GB/rank", "fits"], [
                [str(c.stage), c.offload, str(c.tp), _gb(c.device_need_bytes), _gb(c.host_bytes),
                 "yes" if c.fits else "no"] for c in est.candidates], "llrrrl"),
            f"{verb}: stage {r['stage']}, offload {r['offload']}, tp {r['tp']}. {r['reason']}"]


def _arg(parse: Any, kind: str, high: int) -> Any:
    """Wrap a parser so argparse reports '--flag: <reason>' for bad or absurd values (1..high)."""
    def conv(text: str) -> int:
        try:
            v = parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
        if not 0 < v <= high:
            raise argparse.ArgumentTypeError(f"{kind} must be between 1 and {high:.0e}: {text!r}")
        return v
    conv.__name__ = kind
    return conv


# Bounds on a model config's shape (far above any published model) so a typo fails at once
# instead of building a meta model of 100,000 layers for minutes.
SHAPE_LIMITS = {"num_hidden_layers": 1000, "n_layer": 1000, "hidden_size": 2**20, "n_embd": 2**20,
                "num_attention_heads": 2**14, "n_head": 2**14, "num_key_value_heads": 2**14,
                "intermediate_size": 2**24, "n_inner": 2**24, "vocab_size": 2**24, "head_dim": 2**16,
                "max_position_embeddings": 2**24, "n_positions": 2**24}


def check_model_config(src: str) -> None:
    """Refuse a config.json whose shape fields are not whole numbers in range (UserError naming the key)."""
    path = Path(src) / "config.json" if Path(src).is_dir() else Path(src)
    if not path.is_file():
        from shardwise.train.presets import MODEL_PRESETS  # torch-free, like this module

        preset = " (a `shardwise train` preset, not a file: pass a run's export, RUN/hf)" * (src in MODEL_PRESETS)
        raise UserError(f"{src!r}: no config.json there{preset}; pass an HF model folder or its config.json")
    try:  # a folder's config.json must be a regular file inside it (safe_files)
        raw = read_in(path.parent, path.name) if Path(src).is_dir() else read_regular(path, 64 << 20)
        data = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a readable JSON config ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level must be a JSON object")
    sections = [("", data)] + [(f"{k}.", v) for k, v in data.items() if k.endswith("_config") and isinstance(v, dict)]
    for prefix, section in sections:
        for key, high in SHAPE_LIMITS.items():
            value = section.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise UserError(f"{path}: {prefix}{key} = {value!r} must be a whole number from 1 to "
                                f"{high:,}; fix the config")


EPILOG = """examples:
  shardwise estimate --params 7.5B --devices 64
  shardwise estimate --model ./llama-7b --devices 8 --micro-batch 1 --seq 4096 --device-memory 80GB
  shardwise estimate --params 70B --devices 16 --tp 8 --offload optimizer --json
  shardwise estimate --model ./llama-7b --devices 16 --nodes 2 --gpus-per-node 8 --inter-bw 25GB \\
      --intra-bw 300GB --latency 10us --tflops 400 --micro-batch 1 --seq 4096 --device-memory 80GB
units: counts take K/M/B/T (powers of 1000); GB = 1e9 bytes, GiB = 2^30 bytes, G = GB."""


def main(argv: list[str] | None = None) -> int:
    """`shardwise estimate` CLI; returns the exit code (2 for bad input, naming the flag)."""
    from shardwise.estimate.long_context import add_long_context_args, run_long_context
    from shardwise.estimate.planner_cli import add_planner_args, run_planner

    p = OneLineParser(prog="shardwise estimate", epilog=EPILOG,
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      description="Estimate per-device memory and communication for ZeRO "
                                  "stages 0-3, offload and tensor parallelism.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_arg(parse_count, "count", 10**15), help="parameter count, e.g. 7.5B")
    src.add_argument("--model", help="HF model directory or config.json (exact count, shapes)")
    p.add_argument("--devices", type=_arg(parse_count, "count", 10**8), required=True, help="total devices")
    p.add_argument("--tp", type=_arg(parse_count, "count", 10**6), default=1, help="tensor-parallel degree")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--offload", choices=["none", "optimizer", "params"], default="none")
    p.add_argument("--master", choices=["fp32", "master", "states"], default="fp32",
                   help="fp32 masters (default); 'master': DeepSpeed's {bf16,fp16}_master_weights_and_grads; "
                        "'states': also bf16_optimizer_states (docs/precision.md)")
    p.add_argument("--master-update", choices=["kahan", "stochastic", "nearest"], default="kahan",
                   help="shardwise.master_update of a 16-bit master (kahan keeps a 2-byte compensation)")
    p.add_argument("--micro-batch", type=_arg(parse_count, "count", 10**9), help="micro batch per device")
    p.add_argument("--seq", type=_arg(parse_count, "count", 10**9), help="sequence length")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--device-memory", type=_arg(parse_bytes, "size", 10**18), help="e.g. 80GB, 80GiB")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    add_planner_args(p)
    add_long_context_args(p)
    try:
        args = p.parse_args(argv)
        if args.devices % args.tp:
            p.error(f"--devices {args.devices} is not divisible by --tp {args.tp}")
        if (args.micro_batch is None) != (args.seq is None):
            p.error("--micro-batch and --seq go together")
        if args.master != "fp32" and (args.dtype == "fp32" or (args.master == "states" and args.dtype != "bf16")):
            p.error(f"--master {args.master} does not apply to --dtype {args.dtype} "
                    "(bf16: master, states; fp16: master)")
        if args.micro_batch and not args.model:
            p.error("--micro-batch/--seq need --model (hidden size, layers, heads for activations)")
        facts = None
        if args.model:
            try:
                check_model_config(args.model)
                facts = model_facts(args.model)
            except (ValueError, KeyError, OSError) as exc:  # UserError is a ValueError
                p.error(f"--model: {exc}")
        if facts and facts.num_heads and facts.num_heads % args.tp:
            p.error(f"--tp {args.tp} does not divide the model's {facts.num_heads} attention heads")
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.nodes is not None:
        return run_planner(p, args, facts)
    if args.budget is not None:
        return run_long_context(p, args, facts)
    est = estimate(facts.params if facts else args.params, args.devices, tp=args.tp, dtype=args.dtype,
                   offload=args.offload, micro_batch=args.micro_batch, seq=args.seq, facts=facts,
                   activation_checkpointing=args.activation_checkpointing,
                   device_memory=args.device_memory, master=args.master, kahan=args.master_update == "kahan")
    print(json.dumps(est.to_dict()) if args.json else format_report(est))
    return 0


if __name__ == "__main__":
    sys.exit(main())
