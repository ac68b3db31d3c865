"""``shardwise env``: what this installation can do, for bug reports and a newcomer's first check
(DeepSpeed has ``ds_report``, Accelerate ``accelerate env``).

Versions come from the installed packages' metadata (nothing optional is imported to learn it);
torch is imported to report devices and distributed backends; the DeepSpeed facade's table says
which DeepSpeed version it speaks and how many modules it serves. ``--json`` prints the same as
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib import metadata
from typing import Any

from shardwise.cli_errors import OneLineParser

# packages shardwise works with, and which `pip install shardwise[EXTRA]` brings each
PACKAGES = {"torch": "core", "transformers": "core", "safetensors": "core", "pydantic": "core",
            "accelerate": "hf", "peft": "hf", "trl": "hf", "datasets": "hf", "tensorboard": "monitor",
            "wandb": "monitor", "pytest": "dev", "hypothesis": "dev", "ruff": "dev", "deepspeed": "bench"}


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _devices() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    out: dict[str, Any] = {
        "cpu_threads": torch.get_num_threads(),
        "cuda_build": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "backends": [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                     ("mpi", dist.is_mpi_available())) if ok],
    }
    out["default_backend"] = "nccl" if cuda and "nccl" in out["backends"] else "gloo"
    return out


def _facade() -> dict[str, Any]:
    from shardwise.deepspeed import API_LEVEL, SURFACE, real_deepspeed_location

    return {"deepspeed_api": API_LEVEL, "modules_served": len(SURFACE),
            "names_served": sum(len(v) for v in SURFACE.values()),
            "real_deepspeed": real_deepspeed_location(),
            "use": "shardwise launch --as-deepspeed script.py, or shardwise.install_as_deepspeed()"}


def report() -> dict[str, Any]:
    """Everything ``shardwise env`` prints, as plain data."""
    import shardwise

    extras: dict[str, list[str]] = {}
    for name, extra in PACKAGES.items():
        extras.setdefault(extra, [])
        if _version(name) is None:
            extras[extra].append(name)
    return {
        "shardwise": shardwise.__version__,
        "location": str(shardwise.__path__[0]),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "extras": {k: ("complete" if not missing else "missing " + ", ".join(missing))
                   for k, missing in extras.items()},
        "devices": _devices(),
        "deepspeed_facade": _facade(),
    }


def format_report(rep: dict[str, Any]) -> str:
    dev, fac = rep["devices"], rep["deepspeed_facade"]
    lines = [f"shardwise {rep['shardwise']} ({rep['location']})",
             f"python {rep['python']} on {rep['platform']}", "", "packages:"]
    lines += [f"  {name:<13} {ver or '-- not installed'}" for name, ver in rep["packages"].items()]
    lines += ["", "extras (pip install 'shardwise[EXTRA]'):"]
    lines += [f"  {k:<13} {v}" for k, v in rep["extras"].items() if k != "core"]
    gpus = ", ".join(dev["gpus"]) or "none (CPU only)"
    lines += ["", "devices:", f"  GPUs          {gpus}", f"  torch CUDA    {dev['cuda_build'] or 'CPU build'}",
              f"  CPU threads   {dev['cpu_threads']}",
              f"  backends      {', '.join(dev['backends'])} (shardwise uses {dev['default_backend']} here)"]
    lines += ["", "DeepSpeed facade (`import deepspeed` without DeepSpeed):",
              f"  speaks        DeepSpeed {fac['deepspeed_api']} API: {fac['names_served']} names in "
              f"{fac['modules_served']} modules (docs/hf_trainer.md)",
              f"  turn on       {fac['use']}",
              f"  real one      {fac['real_deepspeed'] or 'not installed (not needed)'}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="shardwise env", formatter_class=argparse.RawDescriptionHelpFormatter,
                      description="Report versions (shardwise, torch, transformers, accelerate, ...), devices, "
                                  "distributed backends, optional extras, and what the DeepSpeed facade serves.")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    rep = report()
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    return 0
