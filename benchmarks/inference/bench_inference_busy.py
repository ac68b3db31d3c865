"""Streamed generation's peak memory on a busy machine: ten fresh processes against the bound.

Issue 39's measurement: a 24-layer Llama (hidden 768, intermediate 2048, vocab 8000, untied head:
695 MiB in fp32) streamed from disk, each run a fresh interpreter that takes its own baseline after
the imports, loads, generates ``--tokens`` tokens and reports its peak growth, anonymous and
file-backed apart. While the runs go, every core is kept busy by a CPU hog this script starts and
stops itself (one spinning process per core), so the threads' scheduling is the busy case.

Reported per mode: the worst and best anonymous peak growth over the runs, as a fraction of the
model, against (a) ``shardwise.inference.bound``'s total and (b) the issue's goal, the formula with
``k = 3`` layers: root + 3 layers + KV cache + activations (19.5% of this model here; the issue asks
for at most 20%). Run it with nothing else on the machine besides its own hog:

    python benchmarks/inference/bench_inference_busy.py                 # disk fp32 and int4, 10 runs each
    python benchmarks/inference/bench_inference_busy.py --runs 3 --modes disk --no-hog
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = r"""
import json, os, sys
import torch
from transformers.models.llama import modeling_llama  # noqa: F401 (imported before the baseline)
from shardwise.inference.load import init_inference
from shardwise.inference.bound import memory_bound

def rss(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

folder, prefetch, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
ids = torch.randint(0, 8000, (1, 16), generator=torch.Generator().manual_seed(0))
base, file_base = rss("VmRSS"), rss("RssFile")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
model = init_inference(folder, offload="disk", prefetch=prefetch)
with torch.no_grad():
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
file_growth = max(rss("RssFile") - file_base, 0)
report = model.memory_report()
print(json.dumps({"anon_peak": rss("VmHWM") - base - file_growth, "file_growth": file_growth,
                  "bound": memory_bound(model, 1, ids.shape[-1], tokens), "report": report}))
"""


def _hog() -> None:
    while True:
        pass


def build(folder: str, quantized: str | None) -> dict:
    """The issue's model in ``folder`` (made once), and its int4 copy in ``quantized``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=8000, hidden_size=768, intermediate_size=2048, num_hidden_layers=24,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=512,
                      tie_word_embeddings=False)
    if not os.path.exists(os.path.join(folder, "config.json")):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    if quantized and not os.path.exists(os.path.join(quantized, "config.json")):
        from shardwise.inference.quantize import quantize_folder

        quantize_folder(folder, quantized, bits=4)
    model = AutoModelForCausalLM.from_config(cfg)
    layer = sum(p.numel() for p in model.model.layers[0].parameters()) * 4
    root = sum(p.numel() for p in model.parameters()) * 4 - 24 * layer
    return {"model_bytes": sum(p.numel() for p in model.parameters()) * 4, "layer_bytes": layer, "root_bytes": root}


def one_run(folder: str, prefetch: int, tokens: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", WORKER, folder, str(prefetch), str(tokens)], env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"worker failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(mode: str, runs: list[dict], sizes: dict) -> dict:
    model = sizes["model_bytes"]
    b = runs[0]["bound"]
    k3 = sizes["root_bytes"] + 3 * sizes["layer_bytes"] + b["kv_cache"] + b["activations"]
    anon = [r["anon_peak"] for r in runs]
    row = {"mode": mode, "runs": len(runs), "worst_anon": max(anon) / model, "best_anon": min(anon) / model,
           "worst_file": max(r["file_growth"] for r in runs) / model,
           "best_file": min(r["file_growth"] for r in runs) / model,
           "bound": b["total"] / model, "k3_formula": k3 / model,
           "worst_within_bound": max(anon) <= b["total"], "worst_within_k3": max(anon) <= k3}
    print(f"{mode}: anonymous peak {row['best_anon']:.1%}..{row['worst_anon']:.1%} of the model over {len(runs)} "
          f"runs (file-backed {row['best_file']:.1%}..{row['worst_file']:.1%}); bound {row['bound']:.1%}, "
          f"k=3 formula {row['k3_formula']:.1%}: worst within bound {row['worst_within_bound']}, "
          f"within k=3 {row['worst_within_k3']}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--modes", default="disk,int4")
    p.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "shardwise_bench_busy"))
    p.add_argument("--no-hog", action="store_true", help="measure on a quiet machine instead")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "inference_busy.json"))
    args = p.parse_args()
    modes = args.modes.split(",")
    plain, q4 = os.path.join(args.folder, "fp32"), os.path.join(args.folder, "int4")
    sizes = build(plain, q4 if "int4" in modes else None)
    cores = 0 if args.no_hog else os.cpu_count() or 2
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(cores)]
    for h in hogs:
        h.start()
    rows, started = [], time.time()
    try:
        for mode in modes:
            folder = plain if mode == "disk" else q4
            rows.append(summarize(mode, [one_run(folder, args.prefetch, args.tokens) for _ in range(args.runs)], sizes))
    finally:
        for h in hogs:
            h.terminate()
    result = {"cpu": _cpu(), "hog_processes": len(hogs), "prefetch": args.prefetch, "tokens": args.tokens,
              "seconds": round(time.time() - started), "sizes": sizes, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
