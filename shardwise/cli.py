"""The `shardwise` command: launch | train | estimate | consolidate | generate."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

SUBCOMMANDS = {
    "train": ("shardwise.train_job", "train a model under a DeepSpeed-style config (the main job)"),
    "estimate": ("shardwise.estimate", "memory and communication per ZeRO stage, and advice"),
    "consolidate": ("shardwise.checkpoint", "turn a sharded checkpoint into an HF model directory"),
    "generate": ("shardwise.generate_cli", "generate text from an HF model directory"),
    "quantize": ("shardwise.quantize", "write an int8/int4 copy of an HF model directory for streamed generate"),
}
ENTRY = {"shardwise.checkpoint": "consolidate_main"}

EPILOG = """examples:
  shardwise launch --nproc 2 -- train --config examples/zero2_llama.json
  shardwise launch --nproc 2 my_script.py --my-flag        (any script, like torchrun)
  shardwise launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc 8 -- train --config c.json
  shardwise estimate --params 7B --devices 8 --device-memory 80GB
  shardwise consolidate ckpt/ hf_out/ --dtype bf16
"""


def launch(argv: list[str]) -> int:
    """torchrun underneath: ``shardwise launch [torchrun flags] [--] (SUBCOMMAND | script.py) ARGS``."""
    p = argparse.ArgumentParser(prog="shardwise launch", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Start one process per rank with torchrun. Unknown flags "
                                            "before the target pass through to torchrun.")
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", default="2",
                   help="processes on this node (default 2)")
    p.add_argument("--nnodes", default="1")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", default=None)
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None)
    p.add_argument("--master-port", "--master_port", dest="master_port", default=None)
    p.add_argument("target", nargs=argparse.REMAINDER, help="a subcommand (train, generate) or a script")
    args, passthrough = p.parse_known_args(argv)
    target = [t for t in args.target]
    if target and target[0] == "--":
        target = target[1:]
    if not target:
        p.error("give what to run: a subcommand (e.g. `-- train --config c.json`) or a script path")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           f"--nnodes={args.nnodes}"]
    if args.nnodes == "1" and args.master_port is None:
        cmd.append("--standalone")
    for flag, val in (("node_rank", args.node_rank), ("master_addr", args.master_addr),
                      ("master_port", args.master_port)):
        if val is not None:
            cmd.append(f"--{flag}={val}")
    cmd += passthrough
    if target[0] in SUBCOMMANDS:
        cmd += ["-m", "shardwise.cli"] + target
    else:
        cmd += target
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: shardwise {launch,train,estimate,consolidate,generate} ...\n")
        print("  launch       start one process per rank (torchrun underneath)")
        for name, (_, desc) in SUBCOMMANDS.items():
            print(f"  {name:<12} {desc}")
        print("\n" + EPILOG)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "launch":
        return launch(rest)
    if cmd not in SUBCOMMANDS:
        print(f"shardwise: unknown command {cmd!r}; choose launch, {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    mod_name, _ = SUBCOMMANDS[cmd]
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        print(f"shardwise {cmd}: not available in this build ({e})", file=sys.stderr)
        return 2
    return int(getattr(mod, ENTRY.get(mod_name, "main"))(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
