"""ZeRO-Inference memory and speed: plain transformers vs resident / cpu / disk streaming.

    python benchmarks/inference/bench_inference.py [--layers 16 --hidden 1024 --inter 2816 --tokens 16]
    python benchmarks/inference/bench_inference.py --quantized --cold --tokens 8     (fp32/bf16/int8/int4 x batch 1, 32)
    python benchmarks/inference/bench_inference.py --quantized --cold --tokens 8 --layers 8 --ratio-rounds 6 (int4/bf16)
        [--ratio-settings 2:1,1:4] [--warmup 2]   (compute threads:prefetch, each in every round; default 2:1)
    python benchmarks/inference/bench_inference.py --memory-runs 3     (the memory test's runs: forked vs fresh)

Builds a Llama from a config (826 MB fp32 by default), saves it, then runs each mode in a fresh
process (peak RSS only grows) via ``tests/inference_cases.py measure`` and prints a table.
``--quantized``: the model saved in fp32 and bf16 and quantized (``shardwise quantize``) to int8
and int4 from the bf16 copy (so those compute in bf16, as the bf16 row does; int4 Linear layers
through torch's CPU int4 kernel; ``int4-r64`` / ``int4-r32``: an int4 file in the kernel order of
the other kind of CPU, which this machine dequantizes per layer), each streamed from disk at batch
1 and 32, against plain transformers with the weights resident and, with ``--accelerate PATH`` (a folder holding the
accelerate package, put on PYTHONPATH for those runs only), Accelerate's ``device_map="auto"``
disk offload. ``--split``: also the seconds per token spent reading, dequantizing and in the int4
kernel (``SHARDWISE_BENCH_SPLIT=1``; wrapping costs a little).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = [("plain", 1), ("resident", 1), ("cpu", 0), ("cpu", 1), ("disk", 0), ("disk", 1), ("disk", 2)]


def _run(folder: str, mode: str, prefetch: int, tokens: int, batch: int, env: dict, warmup: int = 0) -> dict:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "inference_cases.py"), "measure",
                          folder, mode, str(tokens), str(prefetch), str(batch), str(warmup)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def quantized_matrix(args: argparse.Namespace, env: dict) -> None:
    """tokens/s of fp32, bf16, int8, int4 streamed from disk, and plain transformers, at batch 1 and 32."""
    import torch
    from inference_cases import save_large

    from shardwise.inference.quantize import quantize_folder

    base = args.folder or tempfile.mkdtemp(prefix="bench_inference_")
    folders = {"fp32": os.path.join(base, "fp32"), "bf16": os.path.join(base, "bf16")}
    if not os.path.exists(folders["fp32"]):
        print(save_large(folders["fp32"], args.layers, args.hidden, args.inter))
        save_large(folders["bf16"], args.layers, args.hidden, args.inter, dtype=torch.bfloat16)
    from shardwise.inference.quantized_linear import write_block_rows

    native = write_block_rows()
    other = 32 if native == 64 else 64  # the order the other kind of CPU writes: read dequantized here
    kinds_to_write = (("int8", 8, None), ("int4", 4, native), (f"int4-r{other}", 4, other))
    for kind, bits, rows in kinds_to_write[1:2] if args.ratio_rounds else kinds_to_write:
        folders[kind] = os.path.join(base, kind)
        if not os.path.exists(folders[kind]):
            quantize_folder(folders["bf16"], folders[kind], bits, args.group_size, block_rows=rows)
    print(f"int4: this torch packs in blocks of {native} rows; int4-r{other} is a file in the other order")
    if args.ratio_rounds:
        ratio_rounds(folders, args.ratio_rounds, args.tokens, env, args.ratio_settings, args.warmup, args.batch)
        return
    kinds = ("fp32", "bf16", "int8", "int4", f"int4-r{other}")
    rows = [("plain", "fp32"), ("plain", "bf16")] + [("disk", k) for k in kinds]
    if args.accelerate:
        rows += [("accelerate", "fp32"), ("accelerate", "bf16")]
    if args.split:
        env = dict(env, SHARDWISE_BENCH_SPLIT="1")
    print(f"{'mode':<11}{'weights':<8}{'batch':>6}{'tokens/s':>10}{'MB read/token':>15}{'peak RSS growth MB':>20}"
          f"  split s/token")
    for batch in (1, 32):
        for mode, kind in rows:
            run_env = env if mode != "accelerate" else dict(env, PYTHONPATH=f"{args.accelerate}:{env['PYTHONPATH']}")
            try:
                r = _run(folders[kind], mode, 1, args.tokens, batch, run_env)
            except subprocess.CalledProcessError as e:
                print(f"{mode:<11}{kind:<8}{batch:>6}  failed: {e.stderr.strip().splitlines()[-1]}", flush=True)
                continue
            split = r.get("split_s_per_token") or {}
            print(f"{mode:<11}{kind:<8}{batch:>6}{r['tokens_per_s']:>10.2f}{r['read_per_token'] / 1e6:>15.1f}"
                  f"{r['peak_growth'] / 1e6:>20.0f}  " + " ".join(f"{k}={v:.4f}" for k, v in split.items())
                  + (f" placement={r['placement']}" if r.get("placement") else ""),
                  flush=True)


def ratio_rounds(folders: dict[str, str], rounds: int, tokens: int, env: dict,
                 settings: list[tuple[int, int]], warmup: int, batch: int = 1) -> None:
    """int4 against bf16 tokens/s from disk at ``batch``, interleaved round by round (the disk's and the
    machine's drift hit both alike), at each ``(compute threads, prefetch)`` setting in every round;
    writes ``benchmarks/results/int4_ratio.json`` (``int4_ratio_b{batch}.json`` at another batch)."""
    import statistics

    rows: dict[str, list[dict]] = {f"{t}:{pf}": [] for t, pf in settings}
    for r in range(rounds):  # bf16 first in odd rounds, int4 first in even ones: neither always runs first
        order = ("bf16", "int4") if r % 2 == 0 else ("int4", "bf16")
        for threads, prefetch in settings:
            run_env = dict(env, OMP_NUM_THREADS=str(threads))
            row = {k: _run(folders[k], "disk", prefetch, tokens, batch, run_env, warmup)["tokens_per_s"] for k in order}
            row["ratio"] = row["int4"] / row["bf16"]
            rows[f"{threads}:{prefetch}"].append(row)
            print(f"round {r + 1}, {threads} compute threads, prefetch {prefetch}: bf16 {row['bf16']:.2f} "
                  f"tokens/s, int4 {row['int4']:.2f}, ratio {row['ratio']:.2f}", flush=True)
    medians = {}
    for key, rs in rows.items():
        med = medians[key] = {k: statistics.median(row[k] for row in rs) for k in ("bf16", "int4", "ratio")}
        print(f"threads:prefetch {key} median: bf16 {med['bf16']:.2f}, int4 {med['int4']:.2f}, ratio "
              f"{med['ratio']:.2f} (median of the rounds' ratios; min {min(r['ratio'] for r in rs):.2f}, max "
              f"{max(r['ratio'] for r in rs):.2f}; ratio of the medians {med['int4'] / med['bf16']:.2f})")
    out = os.path.join(ROOT, "benchmarks", "results", "int4_ratio.json" if batch == 1 else f"int4_ratio_b{batch}.json")
    with open(out, "w") as f:
        json.dump({"rounds": rows, "median": medians, "tokens": tokens, "warmup_tokens": warmup, "batch": batch,
                   "settings": "compute threads:prefetch",
                   "cold": env.get("SHARDWISE_COLD_READS") == "1", "cpu": _cpu_model()}, f, indent=1)


def _settings(text: str) -> list[tuple[int, int]]:
    """``"2:1,1:4"`` -> [(2, 1), (1, 4)]: compute threads and prefetch depth per setting."""
    try:
        out = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected THREADS:PREFETCH[,THREADS:PREFETCH...]") from None
    if not out or any(len(s) != 2 or s[0] < 1 or s[1] < 0 for s in out):
        raise argparse.ArgumentTypeError(f"{text!r}: expected THREADS:PREFETCH pairs, threads >= 1, prefetch >= 0")
    return out


def forked_against_fresh(runs: int, env: dict) -> None:
    """Peak RSS growth beyond the resident shards, per run, of the memory test's cases
    (``tests/test_inference.py::test_streamed_memory_bound_on_every_run``: 64 layers, fp32 and bf16,
    disk and cpu, 4 tokens) forked from a forkserver as the test runs them, and in fresh interpreters."""
    import torch
    from inference_cases import forked_runs, save_large

    base = tempfile.mkdtemp(prefix="bench_inference_memory_")
    os.environ["OMP_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
    cases, sizes = [], {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        folder = os.path.join(base, name)
        sizes[folder] = save_large(folder, layers=64, hidden=512, inter=1376, dtype=dtype)
        cases += [(folder, "disk"), (folder, "cpu")]
    forked = forked_runs(cases, runs)
    print(f"{'case':<10}{'model MB':>9}  {'forked: excess MB per run':<28}{'fresh: excess MB per run':<28}"
          "worst % of model")
    for folder, mode in cases:
        fresh = [_run(folder, mode, 1, 4, 1, env) for _ in range(runs)]
        model = sizes[folder]["model_bytes"]
        pairs = (("forked", forked[(folder, mode)]), ("fresh", fresh))
        ex = {k: [(r["peak_growth"] - r["resident"]) / 1e6 for r in rs] for k, rs in pairs}
        print(f"{os.path.basename(folder) + ' ' + mode:<10}{model / 1e6:>9.0f}  "
              f"{' '.join(f'{e:.0f}' for e in ex['forked']):<28}{' '.join(f'{e:.0f}' for e in ex['fresh']):<28}"
              f"{100 * max(ex['forked']) * 1e6 / model:.1f} / {100 * max(ex['fresh']) * 1e6 / model:.1f}", flush=True)


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=2816)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--folder", default=None, help="reuse a saved model")
    p.add_argument("--cold", action="store_true", help="evict each layer's pages after reading it "
                   "(SHARDWISE_COLD_READS=1), as a model larger than RAM forces")
    p.add_argument("--modes", default=None, help="e.g. disk:0,disk:1 (default: all)")
    p.add_argument("--batch", type=int, default=1, help="sequences generated together")
    p.add_argument("--quantized", action="store_true", help="fp32/bf16/int8/int4 from disk at batch 1 and 32")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--accelerate", default=None, help="folder holding the accelerate package (pip --target)")
    p.add_argument("--ratio-rounds", type=int, default=0, help="with --quantized: only bf16 and int4 from disk "
                   "at batch 1, in this many interleaved rounds (per-round tokens/s and ratio, and the median)")
    p.add_argument("--ratio-settings", type=_settings, default=[(2, 1)], help="with --ratio-rounds: compute "
                   "threads and prefetch depth per setting, e.g. 2:1,1:4 (each measured in every round)")
    p.add_argument("--warmup", type=int, default=0, help="with --ratio-rounds: an untimed generation of this "
                   "many tokens first in each run (tokens/s of steady decoding, not the first call's)")
    p.add_argument("--memory-runs", type=int, default=0, help="the memory test's 64-layer models: this many runs "
                   "per case forked from a forkserver (as the test does) and as many fresh interpreters")
    p.add_argument("--split", action="store_true", help="time per token in reads / dequantization / int4 kernel")
    args = p.parse_args()
    if args.ratio_rounds and not args.quantized:
        p.error("--ratio-rounds compares the quantized rows: give --quantized too")
    if args.memory_runs and args.quantized:
        p.error("--memory-runs runs the memory test's models: not with --quantized")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, ROOT)
    env = dict(os.environ, PYTHONPATH=ROOT)
    if args.cold:
        env["SHARDWISE_COLD_READS"] = "1"
    if args.quantized:
        quantized_matrix(args, env)
        return
    if args.memory_runs:
        forked_against_fresh(args.memory_runs, env)
        return
    from inference_cases import save_large

    folder = args.folder or tempfile.mkdtemp(prefix="bench_inference_")
    sizes = save_large(folder, args.layers, args.hidden, args.inter) if not args.folder else None
    modes = MODES
    if args.modes:
        modes = [(m.split(":")[0], int(m.split(":")[1]) if ":" in m else 1) for m in args.modes.split(",")]
    print(f"model {folder}: {sizes}")
    print(f"{'mode':<9}{'prefetch':>9}{'peak RSS growth MB':>20}{'whole layers MB':>17}{'tokens/s':>10}")
    for mode, prefetch in modes:
        r = _run(folder, mode, prefetch, args.tokens, args.batch, env)
        gathered = f"{r['peak_gathered'] / 1e6:.0f}" if r["peak_gathered"] else "-"
        print(f"{mode:<9}{prefetch if mode in ('cpu', 'disk') else '-':>9}{r['peak_growth'] / 1e6:>20.0f}"
              f"{gathered:>17}{r['tokens_per_s']:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
