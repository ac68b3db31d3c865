"""The FLOPs profile as text, in DeepSpeed's shape: summary lines, the aggregated profile by depth,
the per-module tree (to ``module_depth``), plus what DeepSpeed lacks: the counted backward, and MFU."""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.monitor.flops import RULE, FlopsProfiler, number, params_str

LINE = "{:<70}  {:<8}"


def _pct(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, 2) if whole else 0:g}%"


def _maybe(x: float | None, unit: str = "") -> str:
    return "not counted" if x is None else number(x, unit)


def summary_lines(prof: FlopsProfiler, s: dict[str, Any], ctx: dict[str, Any]) -> list[str]:
    """The summary block; ``ctx``: step, world, dp, mp, micro batch, and the wall-clock step times (s)."""
    mp = ctx["mp"]
    rows = [("world size: ", ctx["world"]), ("data parallel size: ", ctx["dp"]), ("model parallel size: ", mp),
            ("batch size per GPU: ", ctx["micro"]),
            ("params per GPU (full parameters, also at ZeRO-3): ", params_str(s["params"])),
            ("params of model = params per GPU * mp_size: ", params_str(s["params"] * mp)),
            ("fwd MACs per GPU: ", number(s["fwd_macs"], "MACs")),
            ("fwd flops per GPU: ", number(s["fwd_flops"])),
            ("fwd flops of model = fwd flops per GPU * mp_size: ", number(s["fwd_flops"] * mp)),
            ("fwd latency: ", number(s["fwd_latency_s"], "s")),
            ("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
             number(s["fwd_flops"] / s["fwd_latency_s"] if s["fwd_latency_s"] else 0, "FLOPS")),
            ("bwd flops per GPU (counted): ", _maybe(s["bwd_flops"])),
            ("bwd latency: ", number(s["bwd_latency_s"], "s")),
            ("fwd+bwd flops per GPU (counted): ",
             _maybe(None if s["bwd_flops"] is None else s["fwd_flops"] + s["bwd_flops"])),
            ("fwd+bwd FLOPS per GPU = fwd+bwd flops / (fwd+bwd latency): ", _maybe(s["fwd_bwd_flops_per_s"], "FLOPS"))]
    peak = s["peak_flops"]
    rows.append(("peak FLOPS per GPU: ", f"{number(peak, 'FLOPS')} ({s['peak_source']})" if peak
                 else f"unknown ({s['peak_source']})"))
    rows.append(("MFU = fwd+bwd FLOPS per GPU / peak FLOPS: ",
                 f"{100 * s['mfu']:.2f}% (latencies measured with the counter on: a lower bound)" if peak
                 else "unknown (no peak)"))
    step_s = ctx.get("step_latency_s")
    if step_s is not None:
        iter_s = s["fwd_latency_s"] + s["bwd_latency_s"] + step_s
        rows += [("step latency: ", number(step_s, "s")), ("iter latency: ", number(iter_s, "s")),
                 ("samples/second: ", round(ctx["micro"] * ctx["world"] / iter_s, 2) if iter_s else 0)]
    head = ["", "-------------------------- DeepSpeed Flops Profiler --------------------------",
            f"Profile Summary at step {ctx['step']}:",
            "Counted with torch.utils.flop_counter.FlopCounterMode on rank 0, one micro-batch; MACs = flops / 2;",
            "FLOPS = flops per second; latencies in seconds; params are whole parameters (not ZeRO shards).", ""]
    return head + [LINE.format(k, str(v)) for k, v in rows]


def _by_depth(prof: FlopsProfiler, flops: dict[str, int]) -> dict[int, dict[str, list[float]]]:
    info: dict[int, dict[str, list[float]]] = {}

    def walk(name: str, module: nn.Module, depth: int) -> None:
        row = info.setdefault(depth, {}).setdefault(type(module).__name__, [0.0, 0.0, 0.0])
        row[0] += flops.get(name, 0) / 2
        row[1] += sum(p.numel() for p in module.parameters())
        row[2] += prof.module_duration(module)
        for c, child in module.named_children():
            walk(f"{name}.{c}" if name else c, child, depth + 1)

    walk("", prof.model, 0)
    return info


def aggregated_lines(prof: FlopsProfiler, flops: dict[str, int], module_depth: int, top: int) -> list[str]:
    info = _by_depth(prof, flops)
    depth = len(info) - 1 if module_depth == -1 else min(module_depth, len(info))
    lines = ["", "----------------------------- Aggregated Profile per GPU -----------------------------",
             f"Top {top} modules in terms of params, MACs or fwd latency at different model depths:"]
    for d in range(depth):
        def best(i: int, fmt, d=d) -> dict[str, str]:
            rows = sorted(info[d].items(), key=lambda kv: kv[1][i], reverse=True)[:top]
            return {k: fmt(v[i]) for k, v in rows}

        lines += [f"depth {d}:", f"    params      - {best(1, params_str)}",
                  f"    MACs        - {best(0, lambda x: number(x, 'MACs'))}",
                  f"    fwd latency - {best(2, lambda x: number(x, 's'))}"]
    return lines


def tree_lines(prof: FlopsProfiler, flops: dict[str, int], module_depth: int) -> list[str]:
    """Each module with params, MACs, fwd latency (and their shares of the model's) and fwd FLOPS."""
    total_p = sum(p.numel() for p in prof.model.parameters())
    total_f, total_t = flops.get("", 0), prof.module_duration(prof.model)
    lines = ["", "------------------------------ Detailed Profile per GPU ------------------------------",
             "Each module: params, share of params, MACs, share of MACs, fwd latency, share of latency, fwd FLOPS", ""]

    def walk(name: str, label: str, module: nn.Module, depth: int) -> None:
        p, f, t = sum(x.numel() for x in module.parameters()), flops.get(name, 0), prof.module_duration(module)
        lines.append(f"{'  ' * depth}{label}{type(module).__name__}({params_str(p)} = {_pct(p, total_p)} Params, "
                     f"{number(f / 2, 'MACs')} = {_pct(f, total_f)} MACs, "
                     f"{number(t, 's')} = {_pct(t, total_t)} latency, "
                     f"{number(f / t if t else 0, 'FLOPS')})")
        if module_depth == -1 or depth < module_depth:
            for c, child in module.named_children():
                walk(f"{name}.{c}" if name else c, f"({c}): ", child, depth + 1)

    walk("", "", prof.model, 0)
    return lines


def report(prof: FlopsProfiler, summary: dict[str, Any], ctx: dict[str, Any]) -> str:
    section = prof.section
    flops = prof.module_flops()
    lines = summary_lines(prof, summary, ctx)
    lines += aggregated_lines(prof, flops, section.module_depth, section.top_modules)
    if section.detailed:
        lines += tree_lines(prof, flops, section.module_depth)
    lines.append(RULE)
    return "\n".join(lines) + "\n"
