"""ZeRO++ quantized collectives: bytes moved and final loss, with and without quantization.

    python benchmarks/zero/bench_zeropp.py [--steps 200] [--precision fp32|bf16]

Trains the tiny byte-level Llama of tests/zeropp_cases.py on the shipped sonnets at stage 3 on 2
gloo ranks (the configuration of tests/test_zeropp.py::test_sonnets_loss_and_bytes), once per
quantization setting, on the same batches, and prints the markdown table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from rank_pool import RankPool  # noqa: E402
from zeropp_cases import sonnets_config  # noqa: E402

SETTINGS = [  # name, zero_optimization extras, shardwise.quantized_gradient_bits
    ("exact", {}, 8),
    ("qwZ int8", {"zero_quantized_weights": True}, 8),
    ("qgZ int8", {"zero_quantized_gradients": True}, 8),
    ("qwZ + qgZ int8", {"zero_quantized_weights": True, "zero_quantized_gradients": True}, 8),
    ("qgZ int4", {"zero_quantized_gradients": True}, 4),
    ("qwZ int8 + qgZ int4", {"zero_quantized_weights": True, "zero_quantized_gradients": True}, 4),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()
    pool = RankPool(2)
    rows, base = [], None
    try:
        for name, zero, bits in SETTINGS:
            cfg = sonnets_config(3, 8, 2e-3, **zero)
            cfg["shardwise"] = {"quantized_gradient_bits": bits}
            if args.precision == "bf16":
                cfg["bf16"] = {"enabled": True}
            t = time.time()
            res = pool.run("zeropp_cases:train_sonnets", cfg, args.steps)
            secs = time.time() - t
            loss = sum(sum(r["losses"][-20:]) / 20 for r in res) / len(res)
            comm = res[0]["comm"]
            base = base or (loss, comm)
            rows.append((name, comm["all_gather"] / base[1]["all_gather"],
                         comm["reduce_scatter"] / base[1]["reduce_scatter"], loss, (loss - base[0]) / base[0], secs))
    finally:
        pool.close()
    print(f"| setting ({args.precision}, {args.steps} steps) | all-gather bytes / exact | reduce-scatter bytes / "
          "exact | loss (mean of last 20 steps) | vs exact | run s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, ag, rs, loss, rel, secs in rows:
        print(f"| {name} | {ag:.4f} | {rs:.4f} | {loss:.4f} | {rel:+.2%} | {secs:.0f} |")


if __name__ == "__main__":
    main()
