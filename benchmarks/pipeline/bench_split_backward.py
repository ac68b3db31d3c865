"""What splitting a backward in two costs (the zero-bubble schedule's B and W, ``shardwise/pipeline/split.py``).

Two decoder layers of a small Llama (``benchmarks/shared/models.py``) run forward on a stage's input
(``--rows`` x ``--seq`` tokens, hidden 256), then backward either in one pass, or split: the graph walk
(``SplitBackward(...)``), B (the input's gradient) and W (the weights'). Each is timed ``--repeats`` times,
alternating; printed: the minimum and the median of each, in ms, and whether the two give the same
weight gradients, bit for bit.

    python benchmarks/pipeline/bench_split_backward.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from shardwise.pipeline.split import SplitBackward

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.models import llama  # noqa: E402

SHAPE = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = llama(SHAPE, seed=0)
    layers, rotary = model.model.layers, model.model.rotary_emb
    params = list(layers.parameters())
    positions = torch.arange(args.seq)[None]

    def forward(x: torch.Tensor) -> torch.Tensor:
        emb = rotary(x, positions)
        for layer in layers:
            out = layer(x, position_embeddings=emb)
            x = out[0] if isinstance(out, tuple) else out
        return x

    g = torch.Generator().manual_seed(0)
    x0, grad = torch.randn(args.rows, args.seq, 256, generator=g), torch.randn(args.rows, args.seq, 256, generator=g)
    times: dict[str, list[float]] = {"one backward": [], "split (walk + B + W)": [], "walk": [], "B": [], "W": []}
    same = True
    for _ in range(args.repeats):
        layers.zero_grad(set_to_none=True)
        out = forward(x0.clone().requires_grad_())
        t = time.perf_counter()
        out.backward(grad)
        times["one backward"].append(time.perf_counter() - t)
        whole = [p.grad.clone() for p in params]
        layers.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out = forward(x)
        t0 = time.perf_counter()
        split = SplitBackward([out], [grad], [x], params)
        t1 = time.perf_counter()
        split.input_pass()
        t2 = time.perf_counter()
        split.weight_pass()
        t3 = time.perf_counter()
        for k, v in (("walk", t1 - t0), ("B", t2 - t1), ("W", t3 - t2), ("split (walk + B + W)", t3 - t0)):
            times[k].append(v)
        same = same and all(torch.equal(a, p.grad) for a, p in zip(whole, params, strict=True))
    print("| pass | min, ms | median, ms |")
    print("| --- | --- | --- |")
    for name, ts in times.items():
        ts.sort()
        print(f"| {name} | {ts[0] * 1e3:.1f} | {ts[len(ts) // 2] * 1e3:.1f} |")
    print(f"weight gradients bit for bit equal: {same}")


if __name__ == "__main__":
    main()
