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
import re
import shutil
import subprocess
import sys
from importlib import metadata
from typing import Any

from shardwise.errors import OneLineParser

# packages shardwise works with, and which `pip install shardwise[EXTRA]` brings each
PACKAGES = {"torch": "core", "transformers": "core", "safetensors": "core", "pydantic": "core",
            "accelerate": "hf", "peft": "hf", "trl": "hf", "datasets": "hf", "tensorboard": "monitor",
            "wandb": "monitor", "pytest": "dev", "hypothesis": "dev", "ruff": "dev", "deepspeed": "bench"}


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> dict[str, str | None]:
    """The NVIDIA driver's version and the newest CUDA it serves, from ``nvidia-smi``'s banner (None
    without one): what a torch CUDA build must not exceed, the first thing to check when torch sees no GPU."""
    out: dict[str, str | None] = {"driver": None, "driver_cuda": None}
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return out
    try:
        text = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return out
    for key, label in (("driver", "Driver Version"), ("driver_cuda", "CUDA Version")):
        found = re.search(label + r":\s*([0-9][0-9.]*)", text)
        out[key] = found.group(1) if found else None
    return out


def _nccl_version(torch: Any) -> str | None:
    """NCCL's version as this torch was built with it (None on a CPU build)."""
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def _devices() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from shardwise.launch.devices import CPU_RANKS, visible_setting

    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())] if cuda else []
    out: dict[str, Any] = {
        "cpu_threads": torch.get_num_threads(),
        "cuda_build": torch.version.cuda,
        "gpus": [f"{g.name} ({g.total_memory / 2**30:.0f} GiB)" for g in gpus],
        "visible": visible_setting(),
        **_driver(),
        "nccl": _nccl_version(torch) if torch.version.cuda else None,
        "backends": [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                     ("mpi", dist.is_mpi_available())) if ok],
    }
    nccl = bool(gpus) and "nccl" in out["backends"]
    out["default_backend"] = "nccl" if nccl else "gloo"
    out["launch_auto"] = f"{len(gpus)} rank(s) on nccl, one per GPU" if nccl else f"{CPU_RANKS} CPU ranks on gloo"
    return out


def gpu_advice(dev: dict[str, Any]) -> str | None:
    """What to do when the machine has an NVIDIA driver but torch sees no GPU (None otherwise)."""
    if dev["gpus"] or dev["driver"] is None:
        return None
    if not dev["cuda_build"]:
        return "this torch is the CPU build and the machine has an NVIDIA driver: `make setup TORCH_BUILD=cuda`"
    if dev["visible"] != "CUDA_VISIBLE_DEVICES unset":
        return f"torch sees no GPU with {dev['visible']}"
    return (f"torch built for CUDA {dev['cuda_build']} sees no GPU: the driver serves CUDA up to "
            f"{dev['driver_cuda'] or '?'}; install a torch built for that CUDA, or update the driver")


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
    lines += ["", "devices:", *_device_lines(dev)]
    lines += ["", "DeepSpeed facade (`import deepspeed` without DeepSpeed):",
              f"  speaks        DeepSpeed {fac['deepspeed_api']} API: {fac['names_served']} names in "
              f"{fac['modules_served']} modules (docs/hf_trainer.md)",
              f"  turn on       {fac['use']}",
              f"  real one      {fac['real_deepspeed'] or 'not installed (not needed)'}"]
    return "\n".join(lines)


def _device_lines(dev: dict[str, Any]) -> list[str]:
    gpus = ", ".join(f"cuda:{i} {g}" for i, g in enumerate(dev["gpus"])) or "none (CPU only)"
    driver = f"{dev['driver']} (serves CUDA up to {dev['driver_cuda'] or '?'})" if dev["driver"] else "none found"
    torch_cuda = (f"CUDA {dev['cuda_build']}; NCCL {dev['nccl'] or '-- not in this build'}" if dev["cuda_build"]
                  else "CPU only (no CUDA, no NCCL)")
    lines = [f"  GPUs          {gpus}; {dev['visible']}", f"  NVIDIA driver {driver}",
             f"  torch build   {torch_cuda}",
             f"  CPU threads   {dev['cpu_threads']}",
             f"  backends      {', '.join(dev['backends'])} (shardwise uses {dev['default_backend']} here)",
             f"  launch        --nproc auto starts {dev['launch_auto']}"]
    advice = gpu_advice(dev)
    return lines + ([f"  note          {advice}"] if advice else [])


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="shardwise env", formatter_class=argparse.RawDescriptionHelpFormatter,
                      description="Report versions (shardwise, torch, transformers, accelerate, ...), devices, "
                                  "distributed backends, optional extras, and what the DeepSpeed facade serves.")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    rep = report()
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    return 0
