"""A machine with 0, 1 or 2 GPUs, with torch's report faked (no GPU here): which world and backend
``shardwise launch`` picks, its refusals and ``init_distributed``'s (one line, exit 2, before any CUDA
call), ``shardwise env``'s GPU lines, and ``make run``'s default (docs/gpu_first_hour.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import shardwise.cli.command as cli
from shardwise.cli import env as env_cmd
from shardwise.comm import core
from shardwise.errors import UserError
from shardwise.launch import devices

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB = ["--", "train", "--run-config", "examples/sonnets.toml"]


def fake_torch(monkeypatch, gpus: int, nccl: bool = True) -> None:
    """torch reports ``gpus`` CUDA devices (and NCCL); any call that would touch CUDA fails the test."""
    def cuda_call(*a, **k):
        raise AssertionError(f"a CUDA call was made: {a} {k}")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    monkeypatch.setattr(torch.cuda, "set_device", cuda_call)
    monkeypatch.setattr(dist, "init_process_group", cuda_call)


@pytest.mark.parametrize("nproc, backend, gpus, want", [
    ("auto", "auto", 0, (2, "gloo")),   # a CPU machine: what `make run` always ran
    ("auto", "auto", 1, (1, "nccl")),   # a one-GPU workstation
    ("auto", "auto", 2, (2, "nccl")),
    ("gpu", "auto", 2, (2, "nccl")),
    ("3", "auto", 0, (3, "gloo")),
    ("2", "auto", 2, (2, "nccl")),
    ("1", "auto", 2, (1, "nccl")),
    ("2", "gloo", 1, (2, "gloo")),      # CPU ranks on a GPU machine, asked for
    ("auto", "gloo", 1, (2, "gloo")),
    ("cpu", "auto", 1, (5, "gloo")),
])
def test_world_and_backend(nproc, backend, gpus, want) -> None:
    assert devices.plan_world(nproc, backend, gpus, cpus=5) == want


@pytest.mark.parametrize("nproc, backend, gpus, words", [
    ("2", "auto", 1, ["--nproc 2: 2 ranks on this node but 1 GPU visible", "--nproc 1", "CUDA_VISIBLE_DEVICES",
                      "--backend gloo"]),
    ("4", "nccl", 2, ["--nproc 4: 4 ranks", "2 GPUs visible", "--nproc 2"]),
    ("auto", "nccl", 0, ["--backend nccl needs GPUs", "0 GPUs visible"]),
    ("gpu", "auto", 0, ["--nproc gpu", "0 GPUs visible"]),
    ("cpu", "nccl", 2, ["--nproc cpu"]),
])
def test_refusals_name_ranks_devices_and_fixes(monkeypatch, nproc, backend, gpus, words) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(UserError) as e:
        devices.plan_world(nproc, backend, gpus)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert "\n" not in str(e.value)


def test_gpu_count_asks_torch_only_where_a_driver_is(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(devices.subprocess, "run", lambda cmd, **k: calls.append(cmd) or SimpleNamespace(
        returncode=0, stdout="2\n"))
    monkeypatch.setattr(devices, "nvidia_driver_present", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert devices.count_gpus() == 0 and not calls  # no driver: no child Python, no 4 s of torch import
    monkeypatch.setattr(devices, "nvidia_driver_present", lambda: True)
    assert devices.count_gpus() == 2 and calls[0][1:] == ["-c", devices.PROBE]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.count_gpus() == 0 and len(calls) == 1  # hidden: 0 without asking
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert devices.gpus_hidden()


def test_a_failed_probe_is_refused_not_read_as_no_gpu(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(devices, "nvidia_driver_present", lambda: True)
    monkeypatch.setattr(devices.subprocess, "run", lambda cmd, **k: SimpleNamespace(
        returncode=1, stdout="", stderr="Traceback ...\nImportError: libcudart.so.13: cannot open shared object"))
    with pytest.raises(UserError, match=r"asking torch how many GPUs it sees failed \(exited with code 1: "
                                        r"ImportError: libcudart"):
        devices.count_gpus()


@pytest.mark.parametrize("gpus, nccl, want", [(0, True, "0"), (1, True, "1"), (2, True, "2"), (2, False, "0")])
def test_probe_reports_what_torch_sees(monkeypatch, gpus, nccl, want) -> None:
    """The child's code itself, run here under the faked report."""
    fake_torch(monkeypatch, gpus, nccl)
    out = StringIO()
    with redirect_stdout(out):
        exec(devices.PROBE, {})  # noqa: S102 - the launcher's probe, as its child runs it
    assert out.getvalue().strip() == want


def _launch(monkeypatch, capsys, gpus: int, *flags: str) -> tuple[int, list, dict, str]:
    ran = []
    monkeypatch.setattr(cli, "count_gpus", lambda: gpus)
    monkeypatch.setattr(cli, "_run_forwarding_signals", lambda cmd, env: ran.append((cmd, env)) or 0)
    monkeypatch.chdir(ROOT)
    code = cli.main(["launch", *flags, *MAIN_JOB])
    return code, ran, (ran[0][1] if ran else {}), capsys.readouterr().err


def test_launch_one_gpu_one_nccl_rank(monkeypatch, capsys) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    code, ran, env, err = _launch(monkeypatch, capsys, 1)
    assert code == 0 and "--nproc_per_node=1" in ran[0][0] and env["SHARDWISE_BACKEND"] == "nccl"
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert err == "shardwise launch: 1 rank on NCCL, one GPU each (1 GPU visible, CUDA_VISIBLE_DEVICES unset)\n"


def test_launch_cpu_machine_unchanged(monkeypatch, capsys) -> None:
    code, ran, env, err = _launch(monkeypatch, capsys, 0)
    assert code == 0 and "--nproc_per_node=2" in ran[0][0] and env["SHARDWISE_BACKEND"] == "gloo" and err == ""


def test_launch_two_ranks_one_gpu_refused(monkeypatch, capsys) -> None:
    code, ran, _, err = _launch(monkeypatch, capsys, 1, "--nproc", "2")
    assert code == 2 and not ran and err.startswith("shardwise launch: error: --nproc 2: 2 ranks on this node")
    assert err.count("\n") == 1


def test_launch_cpu_ranks_on_a_gpu_machine_hide_the_gpu(monkeypatch, capsys) -> None:
    code, ran, env, err = _launch(monkeypatch, capsys, 1, "--nproc", "2", "--backend", "gloo")
    assert code == 0 and "--nproc_per_node=2" in ran[0][0]
    assert env["SHARDWISE_BACKEND"] == "gloo" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert err == "shardwise launch: 2 CPU ranks on gloo (--backend gloo: the 1 GPU hidden from them)\n"


@pytest.mark.subprocess
def test_launch_refusal_end_to_end() -> None:
    """No fakes: this machine has no GPU, so --backend nccl is refused before any rank starts."""
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "launch", "--backend", "nccl", *MAIN_JOB],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.startswith("shardwise launch: error: --backend nccl needs GPUs") and r.stderr.count("\n") == 1


@pytest.mark.subprocess
@pytest.mark.parametrize("nproc, want", [(None, "--nproc auto -- train"), ("3", "--nproc 3 -- train")])
def test_make_run_default_world(nproc, want) -> None:
    """`make run` passes --nproc auto (the launcher decides, as tested above) unless NPROC is given."""
    args = ["make", "-n", "run"] + ([f"NPROC={nproc}"] if nproc else [])
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "NPROC"}).stdout
    assert f"shardwise launch {want} --run-config examples/sonnets.toml" in out, out


def _rank_env(monkeypatch, rank: int, world: int) -> None:
    """A fresh rank process of a torchrun job: its environment, and no process group up yet (the
    suite's one pytest process may hold the world of one that earlier tests' ``initialize`` left)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("SHARDWISE_BACKEND", raising=False)


@pytest.mark.parametrize("rank, world, gpus, words", [
    (1, 2, 1, "LOCAL_RANK=1 under NCCL but 1 GPU visible (CUDA_VISIBLE_DEVICES=\"0\"), so there is no cuda:1"),
    (0, 2, 1, "LOCAL_WORLD_SIZE=2 ranks on this node under NCCL but 1 GPU visible"),
    (2, 4, 2, "LOCAL_RANK=2 under NCCL but 2 GPUs visible"),
])
def test_init_distributed_refuses_before_any_cuda_call(monkeypatch, rank, world, gpus, words) -> None:
    _rank_env(monkeypatch, rank, world)
    fake_torch(monkeypatch, gpus)
    with pytest.raises(UserError) as e:
        core.init_distributed()
    assert words in str(e.value) and "--backend gloo" in str(e.value) and "\n" not in str(e.value)


class Reached(Exception):
    """init_distributed got past its checks to the named call."""


@pytest.mark.parametrize("gpus, env_backend, want", [(2, None, ("set_device", 1)), (0, None, ("init", "gloo")),
                                                     (2, "gloo", ("init", "gloo")), (2, "nccl", ("set_device", 1))])
def test_init_distributed_backend_and_device(monkeypatch, gpus, env_backend, want) -> None:
    _rank_env(monkeypatch, 1, 2)
    fake_torch(monkeypatch, gpus)
    if env_backend:
        monkeypatch.setenv("SHARDWISE_BACKEND", env_backend)

    def reached(*what):
        raise Reached(what)

    monkeypatch.setattr(torch.cuda, "set_device", lambda i: reached("set_device", i))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **k: reached("init", backend))
    with pytest.raises(Reached) as e:
        core.init_distributed()
    assert e.value.args[0] == want


def test_bad_backend_env_refused(monkeypatch) -> None:
    _rank_env(monkeypatch, 0, 1)
    monkeypatch.setenv("SHARDWISE_BACKEND", "mpi2")
    with pytest.raises(UserError, match="SHARDWISE_BACKEND='mpi2': choose nccl, gloo or auto"):
        core.init_distributed()


def test_train_rank_without_gpu_one_line_exit_2(monkeypatch, capsys, tmp_path) -> None:
    """What plain torchrun would start on a one-GPU machine: rank 1 ends with one line, exit code 2."""
    _rank_env(monkeypatch, 1, 2)
    fake_torch(monkeypatch, 1)
    monkeypatch.chdir(ROOT)
    code = cli.main(["train", "--model", "llama-micro", "--steps", "1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("shardwise train: error: LOCAL_RANK=1 under NCCL") and err.count("\n") == 1


SMI = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: 13.0     |
"""


def _fake_gpu_machine(monkeypatch, gpus: int, cuda_build: str | None) -> None:
    fake_torch(monkeypatch, gpus)
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="NVIDIA H200", total_memory=139 * 2**30))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 7))
    monkeypatch.setattr(env_cmd.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None)
    monkeypatch.setattr(env_cmd.subprocess, "run", lambda cmd, **k: SimpleNamespace(stdout=SMI, returncode=0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")


def test_env_reports_gpus_driver_cuda_nccl(monkeypatch) -> None:
    _fake_gpu_machine(monkeypatch, 1, "13.0")
    text = env_cmd.format_report(env_cmd.report())
    for line in ['  GPUs          cuda:0 NVIDIA H200 (139 GiB); CUDA_VISIBLE_DEVICES="0"',
                 "  NVIDIA driver 580.95.05 (serves CUDA up to 13.0)",
                 "  torch build   CUDA 13.0; NCCL 2.27.7",
                 "  backends      gloo, nccl (shardwise uses nccl here)",
                 "  launch        --nproc auto starts 1 rank(s) on nccl, one per GPU"]:
        assert line in text.splitlines(), (line, text)
    assert "  note" not in text


def test_env_cpu_build_on_a_gpu_machine_says_what_to_install(monkeypatch) -> None:
    _fake_gpu_machine(monkeypatch, 0, None)
    text = env_cmd.format_report(env_cmd.report())
    assert "  torch build   CPU only (no CUDA, no NCCL)" in text.splitlines()
    assert "  launch        --nproc auto starts 2 CPU ranks on gloo" in text.splitlines()
    assert "`make setup TORCH_BUILD=cuda`" in text


def test_env_on_this_cpu_machine() -> None:
    dev = env_cmd.report()["devices"]
    assert dev["gpus"] == [] and dev["default_backend"] == "gloo" and dev["visible"] == 'CUDA_VISIBLE_DEVICES=""'
    assert (env_cmd.gpu_advice(dev) is None) == (dev["driver"] is None)  # CUDA hidden from this tier


@pytest.mark.subprocess
def test_the_cpu_tier_hides_the_gpus_from_every_process() -> None:
    """tests/conftest.py: this tier's ranks are CPU ranks on gloo on a GPU machine too (and its children)."""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
    code = "import torch, shardwise.comm.devices as d; print(torch.cuda.is_available(), d.choose_backend(None))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.stdout.split() == ["False", "gloo"], r.stderr[-2000:]


def _generate(monkeypatch, capsys, tmp_path, gpus: int, *flags: str) -> tuple[int, list, str]:
    """``shardwise generate --nproc 2`` on a machine with ``gpus`` GPUs, up to the rank launch."""
    ran = []
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(cli, "count_gpus", lambda: gpus)
    monkeypatch.setattr(cli, "_run_forwarding_signals", lambda cmd, env: ran.append((cmd, env)) or 0)
    for name in ("RANK", "CUDA_VISIBLE_DEVICES", "SHARDWISE_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    code = cli.main(["generate", "--model", str(tmp_path), "--prompt", "Hi", "--nproc", "2", *flags])
    return code, ran, capsys.readouterr().err


def test_generate_two_ranks_one_gpu_advice_is_a_flag_it_has(monkeypatch, capsys, tmp_path) -> None:
    """The refusal's advice (--backend gloo) is an option of `generate` itself, and following it
    starts 2 CPU ranks with the GPU hidden, as `shardwise launch --backend gloo` does."""
    code, ran, err = _generate(monkeypatch, capsys, tmp_path, 1)
    assert code == 2 and not ran and err.count("\n") == 1
    assert err.startswith("shardwise generate: error: --nproc 2: 2 ranks on this node") and "--backend gloo" in err
    code, ran, err = _generate(monkeypatch, capsys, tmp_path, 1, "--backend", "gloo")
    cmd, env = ran[0]
    assert code == 0 and "--nproc_per_node=2" in cmd and cmd[cmd.index("shardwise.cli") + 1] == "generate"
    assert env["SHARDWISE_BACKEND"] == "gloo" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert err == "shardwise launch: 2 CPU ranks on gloo (--backend gloo: the 1 GPU hidden from them)\n"


def test_generate_backend_without_ranks_refused(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--model", str(tmp_path), "--prompt", "Hi", "--backend", "gloo"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("shardwise generate: error: --backend gloo picks the ranks' backend: add --nproc N")
