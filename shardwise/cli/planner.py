"""The step-time planner's flags on `shardwise estimate` (``--nodes`` turns the planner on)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from shardwise.estimate.memory import ModelFacts, count_params, parse_bytes
from shardwise.estimate.planner import Cluster, format_plans, plan

_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _positive(parse: Any, what: str) -> Any:
    def conv(text: str) -> Any:
        try:
            v = parse(text)
        except (ValueError, OverflowError) as exc:
            raise argparse.ArgumentTypeError(f"not a {what}: {text!r}") from exc
        if not v > 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{what} must be positive and finite: {text!r}")
        return v
    conv.__name__ = what
    return conv


def parse_seconds(text: str) -> float:
    """'10us', '5ms', '0.001', '2s' -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*(s|ms|us|µs|ns)?\s*", text)
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * _TIME_UNITS[m.group(2) or "s"]


def add_planner_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("step-time planner (alpha-beta model; --nodes turns it on)")
    g.add_argument("--nodes", type=_positive(int, "node count"), help="nodes in the cluster")
    g.add_argument("--gpus-per-node", type=_positive(int, "device count"), default=8)
    g.add_argument("--intra-bw", type=_positive(parse_bytes, "bandwidth"), default=parse_bytes("150GB"),
                   help="bytes/s per device inside a node (default 150GB, NVLink-class)")
    g.add_argument("--inter-bw", type=_positive(parse_bytes, "bandwidth"), default=parse_bytes("12.5GB"),
                   help="bytes/s per device across nodes (its share of the NICs; default 12.5GB = 100 Gb/s)")
    g.add_argument("--latency", type=_positive(parse_seconds, "latency"), default=1e-5,
                   help="seconds per ring step (alpha), e.g. 10us")
    g.add_argument("--tflops", type=_positive(float, "TFLOP/s"), default=300.0,
                   help="achieved dense TFLOP/s per device")
    g.add_argument("--top", type=_positive(int, "count"), default=10, help="layouts to list")


def run_planner(p: argparse.ArgumentParser, args: argparse.Namespace, facts: ModelFacts | None) -> int:
    """Price every layout and print the fastest ones (or all of them as JSON)."""
    c = Cluster(args.nodes, args.gpus_per_node, args.intra_bw, args.inter_bw, args.latency, args.tflops)
    if args.devices != c.devices:
        try:
            p.error(f"--devices {args.devices} differs from --nodes x --gpus-per-node = {c.devices}")
        except SystemExit as exc:
            return int(exc.code or 2)
    params = facts.params if facts else args.params
    dtype = args.dtype
    plans = plan(params if isinstance(params, int) else count_params(params), c, dtype=dtype, facts=facts,
                 micro_batch=args.micro_batch or 1, seq=args.seq or 2048,
                 activation_checkpointing=args.activation_checkpointing, device_memory=args.device_memory)
    if args.json:
        print(json.dumps([x.to_dict() for x in plans[: args.top]]))
    else:
        print(format_plans(plans, args.top))
    return 0
