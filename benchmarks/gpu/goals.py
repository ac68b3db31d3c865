"""The goals of shardwise on one GPU, read from a ``benchmarks/gpu_check.py`` report: met, not met, or not
measured (its section was skipped, failed, or lacks the number: never counted as met).

1. every row matches: stages (fp32 within a multiple of torch's own spread, bf16 within its bound),
   determinism, parallel (TP / SP / EP at degree 1) and checkpoint;
2. ZeRO-3's peak memory <= FSDP2's, and 3. its step time <= FSDP2's (medians over the rounds);
4. ZeRO-3's MFU >= torch's own single-GPU baseline's (autocast bf16, no sharding);
5. ZeRO-Inference >= 90% of the host-to-device copy limit measured in the same run;
6. offload deterministic: three identical runs of every offload mode bitwise equal;
7. the main job (``shardwise train``) runs and its loss falls;
8. the precision section's ZeRO-3 peaks no higher than FSDP2's with the same precision policy (fp32
   masters against fp32 parameters, bf16 master + states with nearest rounding against bf16 parameters);
9. every bf16-state mode's peak at or below DeepSpeed's reported ratio to fp32 masters (18.93 / 31.38).
"""

from __future__ import annotations

MATCH_SECTIONS = ("stages", "determinism", "parallel", "checkpoint")
COPY_FRACTION = 0.9
DEEPSPEED_RATIO = 18.93 / 31.38  # gpu.precision.DEEPSPEED_RATIO (not imported: that module needs torch)
SAME_POLICY = (("fp32-masters", "fsdp2-fp32-params"), ("bf16-states-nearest", "fsdp2-bf16-params"))


def _rows(report: dict, name: str) -> list[dict] | None:
    """The section's rows, or None when it did not run to the end (skipped, error, timeout)."""
    sec = report["sections"].get(name)
    if sec is None or sec.get("status") not in ("ok", "partial"):
        return None
    return sec.get("rows") or []


def _goal(goal: str, measured: str, met: bool | None) -> dict:
    return {"goal": goal, "measured": measured, "met": met}


def _label(row: dict) -> str:
    keys = ("path", "stage", "precision", "offload")
    return "/".join(str(row[k]) for k in keys if row.get(k) not in (None, ""))


def _every_row_matches(report: dict) -> dict:
    missing = [n for n in MATCH_SECTIONS if _rows(report, n) is None]
    rows = [(n, r) for n in MATCH_SECTIONS for r in (_rows(report, n) or [])]
    bad = [f"{n}:{_label(r)}" for n, r in rows if not r.get("matches")]
    measured = f"{len(rows) - len(bad)} of {len(rows)} rows match" + (f"; not: {', '.join(bad)}" if bad else "")
    if missing:
        measured += f"; not run: {', '.join(missing)}"
    return _goal("every row matches (" + ", ".join(MATCH_SECTIONS) + ")", measured,
                 False if bad else (None if missing or not rows else True))


def _vs_fsdp2(report: dict) -> list[dict]:
    sec = report["sections"].get("step_vs_fsdp2") or {}
    summary = sec.get("summary") or (sec.get("partial") or {}).get("summary") or {}
    sw, fs, base = summary.get("shardwise", {}), summary.get("fsdp2", {}), summary.get("torch", {})
    if not any(str(r.get("device", "")).startswith("cuda") for r in sec.get("rows") or []):
        sw = fs = base = {}  # CPU timings (--smoke) are no answer to a GPU goal
    out = []
    for key, goal, unit in (("peak_GiB", "ZeRO-3 peak memory <= FSDP2's", "GiB"),
                            ("s_per_step", "ZeRO-3 step time <= FSDP2's", "s")):
        a, b = sw.get(key), fs.get(key)
        met = None if a is None or b is None else a <= b
        out.append(_goal(goal, f"ZeRO-3 {a} {unit}, FSDP2 {b} {unit}" if met is not None else "not measured", met))
    a, b = sw.get("MFU"), base.get("MFU")
    met = None if a is None or b is None else a >= b
    out.append(_goal("ZeRO-3 MFU >= torch's single-GPU baseline",
                     f"ZeRO-3 {a:.1%}, torch {b:.1%}" if met is not None else "not measured", met))
    return out


def _inference(report: dict) -> dict:
    rows = _rows(report, "zero_inference") or []
    frac = rows[0].get("fraction_of_copy_limit") if rows else None
    if frac is None:
        return _goal(f"ZeRO-Inference >= {COPY_FRACTION:.0%} of the copy limit", "not measured", None)
    r = rows[0]
    return _goal(f"ZeRO-Inference >= {COPY_FRACTION:.0%} of the copy limit",
                 f"{r['tokens_per_s']:.3g} tokens/s of {r['copy_limit_tokens_per_s']:.3g} "
                 f"({r['pinned_h2d_GBps']:.1f} GB/s over {r['layer_GB_per_token']:.2f} GB a token): {frac:.0%}",
                 frac >= COPY_FRACTION)


def _offload_deterministic(report: dict) -> dict:
    rows = [r for r in _rows(report, "determinism") or [] if r.get("offload")]
    bad = [_label(r) for r in rows if not r.get("matches")]
    if not rows:
        return _goal("offload deterministic (3 runs bitwise equal)", "not measured", None)
    measured = f"{len(rows) - len(bad)} of {len(rows)} offload modes bitwise equal" + (f"; not: {', '.join(bad)}"
                                                                                        if bad else "")
    return _goal("offload deterministic (3 runs bitwise equal)", measured, not bad)


def _train(report: dict) -> dict:
    rows = _rows(report, "train") or []
    if not rows or "loss_falls" not in rows[0]:
        return _goal("shardwise train runs, loss falls", rows[0].get("error", "not measured") if rows else
                     "not measured", False if rows else None)
    r = rows[0]
    return _goal("shardwise train runs, loss falls", f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f} in "
                 f"{r['steps']} steps, {r['tokens_per_s']:,.0f} tokens/s", r["loss_falls"])


def _precision(report: dict) -> list[dict]:
    """Goals 8 and 9, from the GPU peaks of the precision section (none on CPU: not measured)."""
    peaks = {r["run"]: r["peak_GiB"] for r in _rows(report, "precision") or [] if r.get("peak_GiB") is not None}
    pairs = [(a, b) for a, b in SAME_POLICY if a in peaks and b in peaks]
    policy = _goal("ZeRO-3 peak <= FSDP2's with the same precision policy",
                   "; ".join(f"{a} {peaks[a]:.2f} GiB, {b} {peaks[b]:.2f} GiB" for a, b in pairs) or "not measured",
                   all(peaks[a] <= peaks[b] for a, b in pairs) if len(pairs) == len(SAME_POLICY) else None)
    states = sorted(k for k in peaks if k.startswith("bf16-states"))
    ratios = {k: peaks[k] / peaks["fp32-masters"] for k in states if peaks.get("fp32-masters")}
    met = all(v <= DEEPSPEED_RATIO for v in ratios.values()) if len(ratios) == 3 else None
    measured = ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()) or "not measured"
    return [policy, _goal(f"bf16-state peaks <= DeepSpeed's {DEEPSPEED_RATIO:.3f} of fp32 masters'", measured, met)]


def goals(report: dict) -> list[dict]:
    """The goals table's rows, in the order of the module docstring."""
    return [_every_row_matches(report), *_vs_fsdp2(report), _inference(report), _offload_deterministic(report),
            _train(report), *_precision(report)]


def markdown_lines(rows: list[dict]) -> list[str]:
    mark = {True: "met", False: "**not met**", None: "not measured"}
    lines = ["## goals", "", "| goal | measured | |", "|---|---|---|"]
    lines += [f"| {r['goal']} | {r['measured']} | {mark[r['met']]} |" for r in rows]
    return [*lines, ""]
