"""How many ranks on this node, and on which backend: the GPUs torch sees, the launch flags, one answer.

``shardwise launch --nproc auto`` (the default, what ``make run`` passes) starts one rank per GPU
on NCCL where torch sees GPUs, and 2 CPU ranks on gloo where it sees none. A number of ranks larger
than the GPUs under NCCL is refused in one line (it would end in CUDA's "invalid device ordinal" or
NCCL's refusal of two ranks on one device, once per rank); ``--backend gloo`` asks for CPU ranks, and
those ranks are started with the GPUs hidden (``CUDA_VISIBLE_DEVICES=""``) so nothing in them
touches a GPU.

The launcher imports no torch (4 s per launch, see ``tests/test_package_layout.py``). On a machine
without an NVIDIA driver, or with ``CUDA_VISIBLE_DEVICES`` empty, the answer is 0 GPUs at once; on
one with a driver, a child Python asks torch itself (:data:`PROBE`), because only torch knows whether
it is a CUDA build, whether the driver is new enough for it, and which devices
``CUDA_VISIBLE_DEVICES`` leaves. ``init_distributed`` checks the same in every rank
(:func:`rank_gpu_problem`), for jobs started by plain torchrun.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from shardwise.errors import UserError

CPU_RANKS = 2  # the default world where no GPU is visible (what `make run` always ran)
BACKENDS = ("auto", "nccl", "gloo")
BACKEND_ENV = "SHARDWISE_BACKEND"  # the launcher's choice, read by init_distributed in every rank
# run by a child Python: what torch sees (the GPU count under NCCL, 0 without CUDA or NCCL)
PROBE = ("import torch, torch.distributed as d\n"
         "print(torch.cuda.device_count() if torch.cuda.is_available() and d.is_nccl_available() else 0)\n")


def visible_setting(env: dict[str, str] | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` as the refusals quote it."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if value is None else f'CUDA_VISIBLE_DEVICES="{value}"'


def gpus_hidden(env: dict[str, str] | None = None) -> bool:
    """``CUDA_VISIBLE_DEVICES`` set to nothing (or -1, CUDA's other way to say none)."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.strip() in ("", "-1")


def nvidia_driver_present() -> bool:
    """An NVIDIA driver on this machine: its GPUs under /proc (Linux), or ``nvidia-smi`` on PATH."""
    try:
        if os.listdir("/proc/driver/nvidia/gpus"):
            return True
    except OSError:
        pass
    return shutil.which("nvidia-smi") is not None


def count_gpus() -> int:
    """The GPUs the ranks' torch will see under NCCL; 0 without asking torch where there can be none.

    A probe that fails is refused in one line, not read as 0 GPUs: that would start CPU ranks on a
    GPU machine without a word.
    """
    if gpus_hidden() or not nvidia_driver_present():
        return 0
    try:
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
        words = out.stdout.split()
        if out.returncode == 0 and words and words[-1].isdigit():
            return int(words[-1])
        detail = f"exited with code {out.returncode}: {(out.stderr.strip().splitlines() or ['no output'])[-1]}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        detail = f"{type(exc).__name__}: {exc}"
    raise UserError(f"this machine has an NVIDIA driver, and asking torch how many GPUs it sees failed ({detail}); "
                    f"check `{sys.executable} -c 'import torch; print(torch.cuda.device_count())'`, or run CPU ranks "
                    f'with CUDA_VISIBLE_DEVICES="" (and --backend gloo)')


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def plan_world(nproc: str, backend: str, gpus: int, cpus: int | None = None) -> tuple[int, str]:
    """(ranks on this node, backend) for ``--nproc`` / ``--backend`` where torch sees ``gpus`` GPUs.

    Raises :class:`~shardwise.errors.UserError` for what NCCL cannot serve: no GPU, or more
    ranks than GPUs (one line naming the ranks, the visible devices and the three fixes).
    """
    chosen = backend if backend != "auto" else ("nccl" if gpus and nproc != "cpu" else "gloo")
    seen = f"{plural(gpus, 'GPU')} visible ({visible_setting()})"
    if chosen == "nccl" and gpus == 0:
        raise UserError(f"--backend nccl needs GPUs and torch sees none here: {seen}; leave out --backend for "
                        f"CPU ranks on gloo, or install torch's CUDA build (`make setup TORCH_BUILD=cuda`)")
    if nproc == "cpu":
        if chosen == "nccl":
            raise UserError("--nproc cpu starts CPU ranks, which need --backend gloo (or auto), not nccl")
        return (cpus or os.cpu_count() or 1), "gloo"
    if nproc == "gpu" and gpus == 0:
        raise UserError(f"--nproc gpu: one rank per GPU, and {seen}; pass --nproc N for N CPU ranks on gloo")
    if nproc in ("auto", "gpu"):
        return (gpus if chosen == "nccl" else CPU_RANKS), chosen
    ranks = int(nproc)
    if chosen == "nccl" and ranks > gpus:
        raise UserError(f"--nproc {ranks}: {plural(ranks, 'rank')} on this node but {seen}, and NCCL gives each "
                        f"rank its own GPU; pass --nproc {gpus} (or --nproc auto: one rank per GPU), make more "
                        f"GPUs visible with CUDA_VISIBLE_DEVICES, or run {ranks} CPU ranks with --backend gloo")
    return ranks, chosen


def rank_env(backend: str, gpus: int) -> dict[str, str]:
    """What the ranks' environment gets: the backend chosen, and the GPUs hidden from CPU ranks."""
    env = {BACKEND_ENV: backend}
    if backend == "gloo" and gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def launch_notice(ranks: int, backend: str, gpus: int) -> str | None:
    """The one line the launcher prints where GPUs are present (nothing on a CPU-only machine)."""
    if not gpus:
        return None
    if backend == "nccl":
        return (f"{plural(ranks, 'rank')} on NCCL, one GPU each ({plural(gpus, 'GPU')} visible, "
                f"{visible_setting()})")
    return f"{plural(ranks, 'CPU rank')} on gloo (--backend gloo: the {plural(gpus, 'GPU')} hidden from them)"


def rank_gpu_problem(local_rank: int, local_world: int, gpus: int) -> str | None:
    """Why this NCCL rank cannot have a GPU of its own (None when it can), before any CUDA call.

    ``gpus`` is what torch sees in this process; ``local_world`` the ranks of this node
    (torchrun's ``LOCAL_WORLD_SIZE``).
    """
    seen = f"{plural(gpus, 'GPU')} visible ({visible_setting()})"
    fix = (f"start at most {gpus} rank(s) per node (`shardwise launch --nproc auto`), make more GPUs visible "
           f"with CUDA_VISIBLE_DEVICES, or use CPU ranks (`shardwise launch --backend gloo`, or "
           f"init_distributed(backend='gloo'))")
    if gpus == 0:
        return (f"NCCL needs a GPU and torch sees none ({visible_setting()}); use gloo for CPU ranks "
                f"(init_distributed(backend='gloo'), or `shardwise launch --backend gloo`)")
    if local_rank >= gpus:
        return f"LOCAL_RANK={local_rank} under NCCL but {seen}, so there is no cuda:{local_rank}; {fix}"
    if local_world > gpus:
        return (f"LOCAL_WORLD_SIZE={local_world} ranks on this node under NCCL but {seen}: two ranks would share "
                f"one GPU, which NCCL refuses; {fix}")
    return None
