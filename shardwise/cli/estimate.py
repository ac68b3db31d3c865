"""``shardwise estimate``: its flags, checked at the edge, then the library's arithmetic (memory,
communication, step time, the longest sequence)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shardwise.cli.planner import add_planner_args, run_planner
from shardwise.errors import OneLineParser, UserError
from shardwise.estimate.long_context import add_long_context_args, run_long_context
from shardwise.estimate.memory import estimate, model_facts, parse_bytes, parse_count
from shardwise.estimate.nvme import add_offload_args, base_offload, check_nvme_args, nvme_from_args
from shardwise.estimate.report import check_model_config, format_report
from shardwise.train.presets import MODEL_PRESETS


def refuse_train_preset(src: str) -> None:
    """``--model llama-tiny`` names a ``shardwise train`` preset, not a folder: say which folder to pass."""
    if src in MODEL_PRESETS and not Path(src).exists():
        raise UserError(f"{src!r}: no config.json there (a `shardwise train` preset, not a file: pass a run's "
                        "export, RUN/hf); pass an HF model folder or its config.json")

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


EPILOG = """examples:
  shardwise estimate --params 7.5B --devices 64
  shardwise estimate --model ./llama-7b --devices 8 --micro-batch 1 --seq 4096 --device-memory 80GB
  shardwise estimate --params 70B --devices 16 --tp 8 --offload optimizer --json
  shardwise estimate --model ./llama-7b --devices 16 --nodes 2 --gpus-per-node 8 --inter-bw 25GB \\
      --intra-bw 300GB --latency 10us --tflops 400 --micro-batch 1 --seq 4096 --device-memory 80GB
units: counts take K/M/B/T (powers of 1000); GB = 1e9 bytes, GiB = 2^30 bytes, G = GB."""


def main(argv: list[str] | None = None) -> int:
    """`shardwise estimate` CLI; returns the exit code (2 for bad input, naming the flag)."""
    p = OneLineParser(prog="shardwise estimate", epilog=EPILOG,
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      description="Estimate per-device memory and communication for ZeRO "
                                  "stages 0-3, offload, tensor and pipeline parallelism.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_arg(parse_count, "count", 10**15), help="parameter count, e.g. 7.5B")
    src.add_argument("--model", help="HF model directory or config.json (exact count, shapes)")
    p.add_argument("--devices", type=_arg(parse_count, "count", 10**8), required=True, help="total devices")
    p.add_argument("--tp", type=_arg(parse_count, "count", 10**6), default=1, help="tensor-parallel degree")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16")
    add_offload_args(p, _arg(parse_count, "count", 10**13), _arg(parse_bytes, "size", 10**15))
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
    add_pipeline_args(p)
    add_planner_args(p)
    add_long_context_args(p)
    try:
        args = p.parse_args(argv)
        if args.devices % args.tp:
            p.error(f"--devices {args.devices} is not divisible by --tp {args.tp}")
        check_pipeline_args(p, args)
        check_nvme_args(p, args)
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
                refuse_train_preset(args.model)
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
    return run_estimate(args, facts)


def run_estimate(args: argparse.Namespace, facts: Any) -> int:
    """The memory estimate (one stage's with --pp; the NVMe tier with --offload nvme), printed."""
    params = facts.params if facts else args.params
    est = estimate(-(-params // args.pp), args.devices // args.pp, tp=args.tp, dtype=args.dtype,
                   offload=base_offload(args), micro_batch=args.micro_batch,
                   seq=args.seq, facts=facts, activation_checkpointing=args.activation_checkpointing,
                   device_memory=args.device_memory, master=args.master, kahan=args.master_update == "kahan")
    nvme_from_args(est, args)  # --offload nvme: the optimizer's host bytes on disk, the buffers on the host
    print(render(est, args, params))
    return 0


def render(est: Any, args: argparse.Namespace, params: int) -> str:
    """The report (or its JSON), under the pipeline line with --pp."""
    stages = pipeline_note(args.pp, args.micro_batches, params, args.devices, args.schedule)
    if args.json:
        return json.dumps({**est.to_dict(), **({"pipeline": stages} if stages else {})})
    return (stages["line"] + "\n" if stages else "") + format_report(est)


def add_pipeline_args(p: OneLineParser) -> None:
    p.add_argument("--pp", type=_arg(parse_count, "count", 10**4), default=1,
                   help="pipeline stages: the estimate is one stage's (params/pp on devices/pp); under 1F1B stage 0 "
                        "holds pp micro-batches of layers/pp layers, the activations of one micro-batch of all layers")
    p.add_argument("--micro-batches", type=_arg(parse_count, "count", 10**6), default=None,
                   help="micro-batches per batch with --pp (gradient_accumulation_steps): the bubble (pp-1)/(m+pp-1)")
    p.add_argument("--schedule", choices=["1f1b", "gpipe", "zb_h1"], default="1f1b",
                   help="pipeline schedule with --pp (pipeline.schedule): zb_h1's bubble is (pp-1)/(3m+pp-1), every "
                        "stage holding pp micro-batches (docs/pipeline.md)")


def check_pipeline_args(p: OneLineParser, args: argparse.Namespace) -> None:
    """--pp and --micro-batches: exit 2 naming the flag when they cannot apply."""
    if args.devices % (args.tp * args.pp):
        p.error(f"--devices {args.devices} is not divisible by --tp {args.tp} x --pp {args.pp}")
    if args.pp > 1 and (args.nodes is not None or args.budget is not None):
        p.error("--pp is not combined with the step-time planner (--nodes) or --budget yet")
    if args.micro_batches is not None and args.pp == 1:
        p.error("--micro-batches goes with --pp")
    if args.schedule != "1f1b" and args.pp == 1:
        p.error("--schedule goes with --pp")


def pipeline_note(pp: int, micro_batches: int | None, params: int, devices: int,
                  schedule: str = "1f1b") -> dict | None:
    """With --pp: the stages, the micro-batches and the bubble, and the line printed above the stage's report."""
    if pp == 1:
        return None
    m, zb = micro_batches, schedule == "zb_h1"  # zb_h1: forward, input and weight backward of equal times
    bubble = None if m is None else (pp - 1) / ((3 if zb else 1) * m + pp - 1)
    held = {"zb_h1": "every stage's activations under zb_h1: one micro-batch of every layer",
            "1f1b": "stage 0's activations under 1F1B: one micro-batch of every layer",
            "gpipe": f"every stage's activations under GPipe: {m or 'm'} micro-batches of layers/pp layers"}[schedule]
    line = (f"pipeline: {pp} stages of {devices // pp} devices; below is one stage ({-(-params // pp):,} params, "
            f"the layers split evenly; {held})"
            + ("" if bubble is None else f"; bubble (p-1)/({'3m' if zb else 'm'}+p-1) = {bubble:.3f} at {m} "
                                         "micro-batches"))
    return {"stages": pp, "micro_batches": m, "schedule": schedule, "bubble": bubble, "line": line}
