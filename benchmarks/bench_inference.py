"""ZeRO-Inference memory and speed: plain transformers vs resident / cpu / disk streaming.

    python benchmarks/bench_inference.py [--layers 16 --hidden 1024 --inter 2816 --tokens 16]

Builds a Llama from a config (826 MB fp32 by default), saves it, then runs each mode in a fresh
process (peak RSS only grows) via ``tests/inference_cases.py measure`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = [("plain", 1), ("resident", 1), ("cpu", 0), ("cpu", 1), ("disk", 0), ("disk", 1), ("disk", 2)]


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
    args = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from inference_cases import save_large

    folder = args.folder or tempfile.mkdtemp(prefix="bench_inference_")
    sizes = save_large(folder, args.layers, args.hidden, args.inter) if not args.folder else None
    env = dict(os.environ, PYTHONPATH=ROOT)
    if args.cold:
        env["SHARDWISE_COLD_READS"] = "1"
    modes = MODES
    if args.modes:
        modes = [(m.split(":")[0], int(m.split(":")[1]) if ":" in m else 1) for m in args.modes.split(",")]
    print(f"model {folder}: {sizes}")
    print(f"{'mode':<9}{'prefetch':>9}{'peak RSS growth MB':>20}{'whole layers MB':>17}{'tokens/s':>10}")
    for mode, prefetch in modes:
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "inference_cases.py"), "measure",
                              folder, mode, str(args.tokens), str(prefetch), str(args.batch)],
                             capture_output=True, text=True, env=env, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        gathered = f"{r['peak_gathered'] / 1e6:.0f}" if r["peak_gathered"] else "-"
        print(f"{mode:<9}{prefetch if mode in ('cpu', 'disk') else '-':>9}{r['peak_growth'] / 1e6:>20.0f}"
              f"{gathered:>17}{r['tokens_per_s']:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
