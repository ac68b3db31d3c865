"""Peak host memory and time of building one pipeline stage of a Llama: whole (``from_config``, then the
stage kept) against ``shardwise.pipeline.stage_init`` (every parameter on meta, the stage's made real with
the whole build's values). Each way runs in a fresh process (``ru_maxrss`` is a process's peak).

    python benchmarks/pipeline/bench_stage_init.py --layers 16 --hidden 1024 --stages 4

The stage measured is stage 1 (a middle one: its decoder layers only)."""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _config(args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                       num_key_value_heads=args.hidden // 128, tie_word_embeddings=False)


def _one(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from shardwise.pipeline import materialize_stage, stage_init

    per = args.layers // args.stages
    torch.manual_seed(0)
    start = time.perf_counter()
    if args.way == "whole":
        model = AutoModelForCausalLM.from_config(_config(args))
    else:
        with stage_init():
            model = AutoModelForCausalLM.from_config(_config(args))
    stage = torch.nn.ModuleList(model.model.layers[per:2 * per])
    if args.way == "stage_init":
        materialize_stage(stage, model)
    seconds = time.perf_counter() - start
    real = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    return {"way": args.way, "seconds": round(seconds, 2), "peak_rss_mb": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss // 1024, "real_param_mb": real >> 20,
        "stage_param_mb": sum(p.numel() * p.element_size() for p in stage.parameters()) >> 20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--way", choices=["whole", "stage_init"], default=None)
    args = p.parse_args()
    if args.way is not None:
        print(json.dumps(_one(args)))
        return
    for way in ("whole", "stage_init"):
        out = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--hidden", str(args.hidden),
                              "--stages", str(args.stages), "--way", way], capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
