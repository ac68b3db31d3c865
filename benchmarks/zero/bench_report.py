"""The benchmark's modes and its report: the results table, the verdicts, docs/benchmarks.md."""

from __future__ import annotations

import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
DOC = REPO / "docs" / "benchmarks.md"

# name -> (framework, ZeRO stage, precision); the order is the run order and the table's order.
MODES: dict[str, tuple[str, int, str]] = {
    "ddp": ("ddp", 0, "fp32"),
    "sw0": ("shardwise", 0, "fp32"),
    "sw1": ("shardwise", 1, "fp32"),
    "sw2": ("shardwise", 2, "fp32"),
    "ds1": ("deepspeed", 1, "fp32"),
    "ds2": ("deepspeed", 2, "fp32"),
    "sw3": ("shardwise", 3, "fp32"),
    "fsdp2": ("fsdp2", 3, "fp32"),
    "swfn3": ("shardwise-fn", 3, "fp32"),
    "ds3": ("deepspeed", 3, "fp32"),
    "sw1-bf16": ("shardwise", 1, "bf16"),
    "sw2-bf16": ("shardwise", 2, "bf16"),
    "ds2-bf16": ("deepspeed", 2, "bf16"),
    "sw3-bf16": ("shardwise", 3, "bf16"),
    "fsdp2-bf16": ("fsdp2", 3, "bf16"),
    "swfn3-bf16": ("shardwise-fn", 3, "bf16"),
    "ds3-bf16": ("deepspeed", 3, "bf16"),
}
LABELS = {
    "ddp": "torch DDP", "sw0": "shardwise ZeRO-0", "sw1": "shardwise ZeRO-1", "sw2": "shardwise ZeRO-2",
    "ds1": "DeepSpeed ZeRO-1", "ds2": "DeepSpeed ZeRO-2", "sw3": "shardwise ZeRO-3",
    "sw1-bf16": "shardwise ZeRO-1", "sw2-bf16": "shardwise ZeRO-2", "ds2-bf16": "DeepSpeed ZeRO-2",
    "fsdp2": "torch FSDP2", "ds3": "DeepSpeed ZeRO-3", "sw3-bf16": "shardwise ZeRO-3",
    "fsdp2-bf16": "torch FSDP2", "ds3-bf16": "DeepSpeed ZeRO-3",
    "swfn3": "shardwise.shard ZeRO-3 (FSDP-style loop)", "swfn3-bf16": "shardwise.shard ZeRO-3 (FSDP-style loop)",
}
# Same AdamW everywhere (torch's fused kernel, which shardwise also picks on CPU).
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# ZeRO knobs shared by shardwise and DeepSpeed: DDP's 25 MiB fp32 bucket, overlapped communication.
BUCKET = 25 * 2**20 // 4
KEEP = "## Notes (hand-written, kept across reruns)"


def _merge(runs: list[dict]) -> dict:
    """Several repeats of a mode: median of the per-repeat medians, memory of the first."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    best = dict(ok[0])
    best["step_ms_median"] = statistics.median(r["step_ms_median"] for r in ok)
    best["repeats_ms"] = [round(r["step_ms_median"], 1) for r in ok]
    for k in ("fwd_ms", "bwd_ms", "opt_ms"):
        best[k] = statistics.median(r[k] for r in ok)
    return best


def table(results: dict[str, dict]) -> str:
    ddp = results.get("ddp", {}).get("step_ms_median")

    def peer3(prec: str) -> float | None:
        vals = [results[m]["step_ms_median"] for m in (("fsdp2", "ds3") if prec == "fp32"
                                                       else ("fsdp2-bf16", "ds3-bf16"))
                if m in results and "error" not in results[m]]
        return min(vals) if vals else None

    rows = ["| mode | precision | step ms (median) | per repeat | fwd / bwd / opt ms | × DDP "
            "| × fastest stage-3 peer | model states MiB/rank | last loss |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, (_fw, stage, prec) in MODES.items():
        if mode not in results:
            continue
        r = results[mode]
        if "error" in r:
            rows.append(f"| {LABELS[mode]} | {prec} | skipped: {r['error']} | | | | | | |")
            continue
        ms = r["step_ms_median"]
        vs_ddp = f"{ms / ddp:.2f}" if ddp else "–"
        p3 = peer3(prec) if stage == 3 else None
        vs_p3 = f"{ms / p3:.2f}" if p3 else "–"
        mem = max(r["model_state_bytes"]) / 2**20
        split = f"{r['fwd_ms']:.0f} / {r['bwd_ms']:.0f} / {r['opt_ms']:.0f}"
        reps = ", ".join(f"{x:.0f}" for x in r.get("repeats_ms", [ms]))
        rows.append(f"| {LABELS[mode]} | {prec} | {ms:.0f} | {reps} | {split} | {vs_ddp} | {vs_p3} | {mem:.1f} "
                    f"| {r['loss_last_timed']:.4f} |")
    return "\n".join(rows)


def verdicts(results: dict[str, dict]) -> list[str]:
    def ms(m):
        r = results.get(m)
        return None if r is None or "error" in r else r["step_ms_median"]

    out = []
    ddp = ms("ddp")

    def check(label, value, limit, ok):
        if value is None or limit is None:
            out.append(f"- {label}: not measured")
        else:
            out.append(f"- {label}: {value:.0f} ms vs {limit:.0f} ms → {'**met**' if ok else '**not met**'}")

    s0, s1, s2 = ms("sw0"), ms("sw1"), ms("sw2")
    check("stage 0 ≈ DDP (within 5%)", s0, ddp, s0 is not None and ddp is not None and s0 <= 1.05 * ddp)
    for s, v in ((1, s1), (2, s2)):
        check(f"stage {s} within 5% of DDP", v, ddp, v is not None and ddp is not None and v <= 1.05 * ddp)
        d = ms(f"ds{s}")
        check(f"stage {s} faster than DeepSpeed ZeRO-{s}", v, d, v is not None and d is not None and v < d)
    for prec, (sw, f, d) in (("fp32", ("sw3", "fsdp2", "ds3")), ("bf16", ("sw3-bf16", "fsdp2-bf16",
                                                                          "ds3-bf16"))):
        peers = [x for x in (ms(f), ms(d)) if x is not None]
        best = min(peers) if peers else None
        v = ms(sw)
        check(f"stage 3 {prec} ≤ 0.9× the faster of FSDP2 / DeepSpeed ZeRO-3", v,
              None if best is None else 0.9 * best, v is not None and best is not None and v <= 0.9 * best)
    return out


def write_doc(results: dict, meta: dict, tbl: str, checks: list[str]) -> None:
    mem_lines = []
    for mode in MODES:
        r = results.get(mode)
        if r and "error" not in r and r.get("memory_report") and r["memory_report"][0]:
            rep = r["memory_report"][0]
            mem_lines.append(f"| {mode} | " + " | ".join(f"{rep[k] / 2**20:.1f}" for k in
                             ("params", "grads", "master_params", "optimizer_states", "total")) + " |")
    body = f"""# Benchmarks

Generated by `benchmarks/zero/bench_zero.py` (rerun: `{meta['command']}`, or `make bench`).

- **Date:** {meta['date']}
- **Machine:** {meta['machine']}
- **Software:** {meta['software']}
- **shardwise measured:** {meta['shardwise']}
- **Model:** `llama-20m` from `shardwise.cli.train_job` ({meta['params'] / 1e6:.2f}M parameters), sequence
  {meta['seq']}, micro batch {meta['micro']} per rank, {meta['nproc']} ranks on gloo (CPU),
  `OMP_NUM_THREADS=1` per rank; {meta['warmup']} warmup + {meta['steps']} measured steps per mode,
  {meta['repeats']} repeat(s) per mode (round-robin over modes).
- **Same for every mode:** initial weights (same seed), batches, torch's fused `AdamW` ({meta['adamw']}),
  no gradient clipping (`gradient_clipping: 0`, DeepSpeed would default to 1.0), no accumulation.
  shardwise and DeepSpeed get the same `zero_optimization` section: `{meta['zero']}`
  (stage 3 keeps each library's defaults for prefetch / persistence); DDP uses its default 25 MiB
  buckets with `gradient_as_bucket_view=True`; FSDP2 is `fully_shard` per `LlamaDecoderLayer`, then
  the root (`MixedPrecisionPolicy(param_dtype=bfloat16)` for bf16).
- **Step time:** forward + backward + optimizer step, the slowest rank per step, median over the
  measured steps. fwd / bwd / opt is the median split per phase (where a framework hides
  communication in a later phase, e.g. a wait in `step()`, it shows there).
- **Memory:** model-state tensor bytes per rank (params, grads, fp32 masters, optimizer states and
  framework buffers: every tensor storage the job created that is still alive right after a
  backward, deduplicated), not RSS (glibc keeps freed memory). Activations are not
  included.
- **Contention:** {meta['contention']}

## Results

{tbl}

× DDP is against fp32 torch DDP; × fastest stage-3 peer is against the faster of torch FSDP2 and
DeepSpeed ZeRO-3 at the same precision. "last loss" is the loss of the last measured step: fp32
modes see the same weights and data, so it agrees across them up to reduction order.

## Targets (issues 2 and 3)

{chr(10).join(checks)}

## shardwise `memory_report()` (rank 0, MiB, right after a backward)

| mode | params | grads | master_params | optimizer_states | total |
|---|---:|---:|---:|---:|---:|
{chr(10).join(mem_lines)}

## Interpretation

{meta['interpretation']}
"""
    old = DOC.read_text() if DOC.exists() else ""
    if KEEP in old:  # hand-written notes (profiling findings) survive a rerun
        body += "\n" + old[old.index(KEEP):]
    DOC.write_text(body)


def interpret(results: dict) -> str:
    """A short, data-driven reading of the table (the doc's interpretation section)."""
    def ms(m):
        r = results.get(m)
        return None if r is None or "error" in r else r["step_ms_median"]

    lines = []
    ddp = ms("ddp")
    if ddp:
        for m in ("sw0", "sw1", "sw2"):
            if ms(m):
                lines.append(f"{LABELS[m]} runs at {ms(m) / ddp:.2f}× DDP's step time.")
        for m in ("ds1", "ds2", "ds3"):
            if ms(m):
                lines.append(f"{LABELS[m]} runs at {ms(m) / ddp:.2f}× DDP.")
            elif m in results:
                lines.append(f"{LABELS[m]} did not run: {results[m]['error']}.")
    for sw, peers in (("sw3", ("fsdp2", "ds3")), ("sw3-bf16", ("fsdp2-bf16", "ds3-bf16"))):
        v = ms(sw)
        ps = {p: ms(p) for p in peers if ms(p)}
        if v and ps:
            best = min(ps, key=ps.get)
            lines.append(f"{LABELS[sw]} ({MODES[sw][2]}) takes {v:.0f} ms, {v / ps[best]:.2f}× "
                         f"{LABELS[best]} ({ps[best]:.0f} ms).")
    return " ".join(lines)
