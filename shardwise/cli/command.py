"""The `shardwise` command: launch | train | estimate | consolidate | generate | quantize | env."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from shardwise.errors import OneLineParser, UserError, bounded_int, positive_float, run_command
from shardwise.launch.devices import BACKENDS, count_gpus, launch_notice, plan_world, rank_env
from shardwise.launch.net import free_port

SUBCOMMANDS = {
    "train": ("shardwise.cli.train", "train any causal LM on local text: checkpoints, resume, eval, HF export"),
    "estimate": ("shardwise.cli.estimate", "memory and communication per ZeRO stage, and advice"),
    "consolidate": ("shardwise.cli.consolidate", "turn a sharded checkpoint into an HF model directory"),
    "generate": ("shardwise.cli.generate", "generate text from an HF model directory"),
    "quantize": ("shardwise.cli.quantize",
                 "write an int8/int4 copy of an HF model directory for streamed generate"),
    "env": ("shardwise.cli.env", "versions, devices, backends, extras, what the DeepSpeed facade serves"),
}
# `SUBCOMMAND --help` builds these torch-free parsers, so help answers before any heavy import
HELP_PARSERS = {"train": ("shardwise.cli.train_options", "build_parser"),
                "consolidate": ("shardwise.cli.parsers", "consolidate_parser"),
                "generate": ("shardwise.cli.parsers", "generate_parser"),
                "quantize": ("shardwise.cli.parsers", "quantize_parser")}

EPILOG = """examples:
  shardwise train --model llama-micro --data data/sonnets.txt --steps 40 --out runs/first   (one process)
  shardwise launch --nproc 2 -- train --config examples/zero2_llama.json --steps 60 --out runs/zero2
  shardwise launch -- train --run-config examples/sonnets.toml   (one rank per GPU, else 2 CPU ranks)
  shardwise launch --backend gloo --nproc 2 -- train ...         (CPU ranks on a GPU machine)
  shardwise launch --nproc 2 my_script.py --my-flag        (any script, like torchrun)
  shardwise launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc 8 -- train --config c.json
  shardwise estimate --params 7B --devices 8 --device-memory 80GB
  shardwise consolidate ckpt/ hf_out/ --dtype bf16
"""


def _split_target(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``[launcher flags] [--] TARGET ARGS`` into the flags and the target with its arguments.

    With ``--`` the split is there. Without it the target is the first word that is a subcommand
    or an existing file (a script), so flags passed through to torchrun may take their value after
    a space (``--max-restarts 2 train``) as well as after ``=``.
    """
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    for i, word in enumerate(argv):
        if not word.startswith("-") and (word in SUBCOMMANDS or word.endswith(".py") or os.path.isfile(word)):
            return argv[:i], argv[i:]
    return argv, []


def _nproc(text: str) -> str:
    if text in ("auto", "cpu", "gpu"):
        return text
    return str(bounded_int(1, 4096, "--nproc")(text))


def _launch_parser() -> OneLineParser:
    p = OneLineParser(prog="shardwise launch", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                      description="Start one process per rank with torchrun. Unknown flags before the target "
                                  "pass through to torchrun (with their value after a space or '=').",
                      usage="shardwise launch [flags] [--] (SUBCOMMAND | script.py) [ARGS]")
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=_nproc, default="auto",
                   help="processes on this node: a number, or auto (the default: one per GPU torch sees, else "
                        "2 CPU ranks), gpu, cpu (one per core); more than the GPUs under NCCL is refused")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto (the default): NCCL where torch sees GPUs, else gloo; gloo: CPU ranks, the GPUs "
                        "hidden from them")
    p.add_argument("--nnodes", default="1")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=bounded_int(0, 10**6, "--node-rank"))
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None)
    p.add_argument("--master-port", "--master_port", dest="master_port", type=bounded_int(1, 65535, "--master-port"))
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=bounded_int(0, 1000, "--max-restarts"),
                   default=0, help="restart all ranks up to this many times after a rank fails (resume from "
                                   "your latest checkpoint at start; see docs/reliability.md)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default=None)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default=None)
    p.add_argument("--timeout", type=positive_float, default=None,
                   help="seconds any collective may wait before the ranks fail (SHARDWISE_TIMEOUT; default 600)")
    p.add_argument("--as-deepspeed", "--as_deepspeed", dest="as_deepspeed", action="store_true",
                   help="`import deepspeed` in the ranks is shardwise's DeepSpeed facade (HF Trainer, Accelerate; "
                        "see docs/hf_trainer.md)")
    return p


def _torchrun_command(args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    """The torchrun command line (torchrun's agent, run by ``shardwise.launch.agent``): rendezvous,
    restarts, then the flags passed through."""
    cmd = [sys.executable, "-m", "shardwise.launch.agent", f"--nproc_per_node={args.nproc}",
           f"--nnodes={args.nnodes}", f"--max_restarts={args.max_restarts}"]
    single = args.nnodes in ("1", "1:1")
    if args.rdzv_backend is not None:  # dynamic rendezvous the user chose
        cmd.append(f"--rdzv_backend={args.rdzv_backend}")
        endpoint = args.rdzv_endpoint or (f"127.0.0.1:{free_port()}" if single else None)
        if endpoint is None:
            raise UserError("--rdzv-backend on several nodes needs --rdzv-endpoint HOST:PORT (the same on "
                            "every node)")
        cmd.append(f"--rdzv_endpoint={endpoint}")
    elif args.rdzv_endpoint is not None:
        cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint={args.rdzv_endpoint}"]
    elif single and args.master_port is None:
        # One node: c10d rendezvous on a free port with the agent's store. Each restart attempt
        # re-rendezvous and gets fresh store keys, which is what lets a killed rank's job restart
        # on gloo (docs/reliability.md, "Launch and restarts").
        cmd.append("--standalone")
    for flag, val in (("node_rank", args.node_rank), ("master_addr", args.master_addr),
                      ("master_port", args.master_port)):
        if val is not None:
            cmd.append(f"--{flag}={val}")
    return cmd + passthrough


def _check_target(target: list[str], passthrough: list[str], world_size: int | None) -> None:
    """Refuse what torchrun would only fail on after starting every rank."""
    if not target:
        raise UserError("give what to run after the flags: a subcommand (e.g. `-- train --config c.json`) "
                        "or a script path")
    runs_module = any(f in passthrough for f in ("-m", "--module", "--no-python", "--no_python"))
    if target[0] not in SUBCOMMANDS and not runs_module and not os.path.isfile(target[0]):
        raise UserError(f"{target[0]!r} is neither a subcommand ({', '.join(SUBCOMMANDS)}) nor a script "
                        "file; check the path")
    if target[0] == "train":  # argument errors once, here, not once per rank
        from shardwise.cli.train_options import parse_args
        from shardwise.config import SupportedFeatures, load_config

        train_args = parse_args(target[1:])
        if world_size is not None:  # a config error here, not one traceback per rank
            load_config(train_args.ds_config, world_size=world_size, supported=SupportedFeatures.everything())


def launch(argv: list[str]) -> int:
    """torchrun underneath: ``shardwise launch [flags] [--] (SUBCOMMAND | script.py) ARGS``."""
    flags, target = _split_target(argv)
    args, passthrough = _launch_parser().parse_known_args(flags)
    gpus = count_gpus()
    ranks, backend = plan_world(args.nproc, args.backend, gpus)
    args.nproc = str(ranks)
    single = args.nnodes in ("1", "1:1")
    _check_target(target, passthrough, ranks if single else None)
    cmd = _torchrun_command(args, passthrough)
    if target[0] in SUBCOMMANDS:  # the agent leaves their one-line errors (exit 2 or 3) alone
        cmd = [*cmd[:3], "--subcommand", *cmd[3:], "-m", "shardwise.cli", *target]
    else:
        cmd += target
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(rank_env(backend, gpus))
    notice = launch_notice(ranks, backend, gpus)
    if notice is not None:
        print(f"shardwise launch: {notice}", file=sys.stderr, flush=True)
    if args.timeout is not None:
        env["SHARDWISE_TIMEOUT"] = str(args.timeout)
    if not args.as_deepspeed:
        return _run_forwarding_signals(cmd, env)
    import tempfile

    from shardwise.deepspeed import write_hook

    with tempfile.TemporaryDirectory(prefix="shardwise-deepspeed-") as hook:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(write_hook(hook)), env.get("PYTHONPATH")) if p)
        return _run_forwarding_signals(cmd, env)


def _run_forwarding_signals(cmd: list[str], env: dict[str, str]) -> int:
    """Run torchrun; on SIGTERM/SIGINT send SIGTERM to its workers, so they can save and exit 0.

    torchrun runs in its own session (a terminal's Ctrl-C reaches only this process), and the
    signal goes to the workers directly: torchrun itself would turn it into a failure exit.
    """
    import signal

    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum: int, frame: object) -> None:  # noqa: ARG001
        try:
            tids = os.listdir(f"/proc/{proc.pid}/task")
            kids = [int(c) for t in tids for c in open(f"/proc/{proc.pid}/task/{t}/children").read().split()]
        except OSError:  # no /proc children list: let torchrun pass it on
            kids = []
        for pid in kids or [proc.pid]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _usage() -> str:
    lines = [f"usage: shardwise [--version] {{launch,{','.join(SUBCOMMANDS)}}} ...\n",
             "  launch       start one process per rank (torchrun underneath)"]
    lines += [f"  {name:<12} {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    return "\n".join(lines) + "\n\n" + EPILOG


def _fast_help(cmd: str, rest: list[str]) -> bool:
    """Print ``cmd``'s help from its torch-free parser when ``rest`` asks for it (before any ``--``)."""
    args = rest[:rest.index("--")] if "--" in rest else rest
    if cmd not in HELP_PARSERS or not any(a in ("-h", "--help") for a in args):
        return False
    import importlib

    mod_name, fn = HELP_PARSERS[cmd]
    getattr(importlib.import_module(mod_name), fn)().print_help()
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # usage, as argparse does for a missing command: exit 2
        print(_usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from shardwise import __version__

        print(f"shardwise {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "launch":
        return run_command("shardwise launch", launch, rest)
    if cmd not in SUBCOMMANDS:
        print(f"shardwise: error: unknown command {cmd!r}; choose launch, {', '.join(SUBCOMMANDS)}",
              file=sys.stderr)
        return 2
    if _fast_help(cmd, rest):
        return 0
    import importlib

    mod_name, _ = SUBCOMMANDS[cmd]
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        print(f"shardwise {cmd}: error: not available in this build ({e}); install its extras", file=sys.stderr)
        return 2
    return run_command(f"shardwise {cmd}", mod.main, rest)


if __name__ == "__main__":
    sys.exit(main())
