"""Monitoring and profiling sections (issue 37), read back with the real readers.

One job (tests/monitor_job.py, a part of the 2-rank ``--as-deepspeed`` launch the pytest process
shares: tests/facade_launch.py) trains four times on 2 gloo ranks with every section on: ZeRO-2 and
ZeRO-3, through ``shardwise.initialize`` and through ``import deepspeed``. TensorBoard
events are read with tensorboard's ``EventAccumulator``, the CSV files with ``csv``, the offline
W&B run with wandb's own protobuf records; each value is checked against what the loop saw.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import facade_launch  # noqa: E402
import monitor_job as job  # noqa: E402
from tiny_models import build  # noqa: E402

from shardwise.comm.log import CommsLogger  # noqa: E402
from shardwise.config import load_config  # noqa: E402
from shardwise.monitor import MissingExtra, Monitors, peak_flops  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
BATCH = job.MICRO * job.GAS * WORLD
X = [BATCH * (s + 1) for s in range(job.STEPS)]  # the x-axis: global samples after each step
TIMED = ["forward", "backward", "backward_inner", "backward_allreduce", "step"]


def _tags(name: str) -> set[str]:
    tags = {"Train/Samples/train_loss", "Train/Samples/lr", *(f"Train/Samples/elapsed_time_ms_{t}" for t in TIMED)}
    return tags | ({"Train/Samples/loss_scale"} if job.RUNS[name][2] == "fp16" else set())


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    out = facade_launch.part(tmp_path_factory, "monitor")["root"]
    return {"root": out, **json.loads((out / "results.json").read_text())}


def _expected(ranks: list[dict]) -> dict[str, list[float]]:
    """What the loop saw: the mean loss of each step over micro-batches and ranks, and get_lr()."""
    loss = [sum(sum(r["losses"][s]) for r in ranks) / (job.GAS * len(ranks)) for s in range(job.STEPS)]
    return {"Train/Samples/train_loss": loss, "Train/Samples/lr": ranks[0]["lrs"]}


def _check_series(series: dict[str, list[tuple[int, float]]], ranks: list[dict], name: str, rel: float) -> None:
    assert set(series) == _tags(name), name
    for tag, points in series.items():
        assert [x for x, _ in points] == X, (name, tag)  # one value per optimizer step, x = global samples
    for tag, want in _expected(ranks).items():
        assert [v for _, v in series[tag]] == pytest.approx(want, rel=rel), (name, tag)
    for s, timers in enumerate(ranks[0]["timers"]):  # elapsed_time_ms_* are get_wall_clock_timers()'s values
        assert series["Train/Samples/elapsed_time_ms_forward"][s][1] == pytest.approx(timers["fwd"], rel=rel)
        assert timers["fwd"] > 0 and timers["bwd"] >= timers["bwd_inner"] > 0 and timers["step"] > 0


@pytest.mark.parametrize("name", list(job.RUNS))
@pytest.mark.subprocess
def test_tensorboard_events(launched, name):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = launched["root"] / name / "tb" / "job"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1  # one writer: rank 0
    acc = EventAccumulator(str(folder))
    acc.Reload()
    series = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    _check_series(series, launched[name], name, rel=1e-6)  # TensorBoard stores float32


@pytest.mark.parametrize("name", list(job.RUNS))
@pytest.mark.subprocess
def test_csv_files(launched, name):
    folder = launched["root"] / name / "csv" / "job"
    series = {}
    for tag in _tags(name):
        with open(folder / (tag.replace("/", "_") + ".csv"), newline="") as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["step", tag.rsplit("/", 1)[-1]]
        series[tag] = [(int(x), float(v)) for x, v in rows[1:]]
    assert len(list(folder.iterdir())) == len(series)
    _check_series(series, launched[name], name, rel=1e-12)


def _wandb_history(path: Path) -> tuple[str, list[dict]]:
    """The group and history rows of an offline run file (a LevelDB log of wandb's protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, rows, group = path.read_bytes(), 7, b"", [], ""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if room < 7 or (length == 0 and kind == 0):
            pos += room
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (2, 3):
            continue
        record = pb.Record()
        record.ParseFromString(buf)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif record.WhichOneof("record_type") == "run":
            group = record.run.run_group
    return group, rows


@pytest.mark.subprocess
def test_wandb_offline_runs(launched):
    runs = sorted((launched["root"] / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == len(job.RUNS)  # one run per training: rank 0 only
    read = dict(_wandb_history(path) for path in runs)
    assert set(read) == set(job.RUNS)  # each training's run, named by its W&B group
    for name, rows in read.items():
        series: dict[str, list[tuple[int, float]]] = {}
        for row in rows:
            for tag, value in row.items():
                if tag.startswith("Train/"):
                    series.setdefault(tag, []).append((row["_step"], value))
        _check_series(series, launched[name], name, rel=1e-12)


@pytest.mark.subprocess
def test_exactly_one_writer(launched):
    for name in job.RUNS:
        rank0, rank1 = launched[name]
        assert rank0["writers"] == 3 and rank1["writers"] == 0  # tensorboard, csv, wandb
        assert rank1["printed"] == ""  # timers, memory, progress, profile and the comms table: rank 0 only


@pytest.mark.subprocess
def test_printed_lines(launched):
    for name in job.RUNS:
        out = launched[name][0]["printed"].splitlines()
        assert sum(ln.startswith("[Rank 0] time (ms) | fwd_microstep: ") for ln in out) == job.STEPS * job.GAS
        assert sum(ln.startswith("[Rank 0] time (ms) | fwd: ") and "| bwd_allreduce: " in ln
                   for ln in out) == job.STEPS
        for what in ("forward", "backward", "step"):
            assert out.count(f"Engine before {what}") == out.count(f"Engine after {what}") == job.STEPS * job.GAS
        memory = [ln for ln in out if ln.startswith("MA ") and " Max_MA " in ln and " Max_CA " in ln]
        assert len(memory) == 6 * job.STEPS * job.GAS
        progress = [ln for ln in out if ln.startswith("[shardwise] step ")]
        assert len(progress) == job.STEPS  # steps_per_print: 1
        want = _expected(launched[name])["Train/Samples/train_loss"]
        for s, ln in enumerate(progress):
            assert f"step {s + 1}: loss {want[s]:.4f} | lr " in ln and "samples/s" in ln and "tokens/s" in ln
            assert "memory " in ln


@pytest.mark.subprocess
def test_flops_profile_counts_the_full_model(launched):
    model = build("llama")
    ids = torch.zeros(job.MICRO, job.SEQ, dtype=torch.long)
    with FlopCounterMode(display=False) as fwd:
        loss = model(input_ids=ids, labels=ids).loss
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    numel = sum(p.numel() for p in model.parameters())
    for name in job.RUNS:
        prof = launched[name][0]["profile"]
        assert prof["params"] == numel  # whole parameters at ZeRO-3 too (DeepSpeed reports 0 there)
        assert prof["fwd_flops"] == fwd.get_total_flops()  # the same counter on the same shapes: exact
        assert prof["bwd_flops"] == bwd.get_total_flops()
        assert prof["fwd_macs"] * 2 == prof["fwd_flops"]
        assert prof["peak_flops"] is None and prof["mfu"] is None  # CPU: the peak is unknown unless given
        text = (launched["root"] / name / "flops.txt").read_text()
        for line in ("Profile Summary at step 1:", "params per GPU", "fwd MACs per GPU:", "fwd latency:",
                     "bwd flops per GPU (counted):", "Aggregated Profile per GPU", "depth 1:",
                     "Detailed Profile per GPU", "(lm_head): Linear(", "MFU = ", "unknown on CPU"):
            assert line in text, (name, line)


@pytest.mark.parametrize("name", list(job.RUNS))
@pytest.mark.subprocess
def test_comms_summary_matches_the_stage(launched, name):
    """The logger's bytes are comm_stats()'s, and those are the ZeRO paper's per-step volume."""
    stage, psi, elem = job.RUNS[name][0], launched[name][0]["numel"], 2 if job.RUNS[name][2] == "fp16" else 4
    kinds = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "all_reduce": "all_reduce", "broadcast": "broadcast"}
    for rank in launched[name]:
        summary, stats = rank["summary"], rank["comm_stats"]
        assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= set(summary)
        for op, kind in kinds.items():
            assert sum(s["total_bytes"] for s in summary.get(op, {}).values()) == stats[kind], (name, op)
        for sizes in summary.values():
            for s in sizes.values():
                assert s["count"] > 0 and s["total_latency_ms"] > 0 and s["tput_avg_gbps"] >= 0
        gathers_per_step = 2 * job.GAS if stage == 3 else 1  # stage 3: forward and backward of every micro-batch
        assert stats["reduce_scatter"] / job.STEPS == pytest.approx(job.GAS * psi * elem, rel=0.01)
        assert stats["all_gather"] / job.STEPS == pytest.approx(gathers_per_step * psi * elem, rel=0.01)


def test_comet_without_comet_ml_is_one_line():
    if importlib.util.find_spec("comet_ml") is not None:
        pytest.skip("comet_ml is installed")
    cfg = load_config({"train_batch_size": 1, "comet": {"enabled": True, "project": "p"}})
    with pytest.raises(MissingExtra) as info:
        Monitors(cfg, write=True)
    msg = str(info.value)
    assert "\n" not in msg and "comet_ml" in msg and "shardwise[monitor]" in msg and msg.startswith("comet.enabled")


def test_sections_are_checked():
    with pytest.raises(ValueError, match=r"tensorboard\.enabld: unknown key; did you mean 'enabled'"):
        load_config({"train_batch_size": 1, "tensorboard": {"enabld": True}})
    with pytest.raises(ValueError, match="flops_profiler.top_modules"):
        load_config({"train_batch_size": 1, "flops_profiler": {"top_modules": 0}})
    cfg = load_config({"train_batch_size": 1, "comms_logger": {"enabled": True, "prof_all": False,
                                                               "prof_ops": ["all_reduce"]}})
    assert cfg.comms_logger.prof_ops == ["all_reduce"] and cfg.ignored_keys == []


def test_comms_logger_switches_and_bandwidth():
    log = CommsLogger()
    log.enabled, log.prof_all, log.prof_ops = True, False, ["all_reduce"]
    assert log.wants("all_reduce") and not log.wants("all_gather_into_tensor")
    log.record("all_reduce", 10**9, 2 * 10**9, 1000.0, world=4)  # 1 GB in 1 s: 8 Gbps
    s = log.summary()["all_reduce"][10**9]
    assert s["tput_avg_gbps"] == pytest.approx(8.0) and s["busbw_avg_gbps"] == pytest.approx(8.0 * 2 * 3 / 4)
    assert s["count"] == 1 and s["total_bytes"] == 2 * 10**9 and s["msg_size_str"] == "953.67 MB"


def test_comms_logger_verbose_and_debug(capsys):
    log = CommsLogger()
    log.enabled, log.verbose, log.debug = True, True, True
    log.record("reduce_scatter_tensor", 2048, 2048, 2.0, world=2, caller="reduce_grads")
    line = capsys.readouterr().out.strip()
    assert line.startswith("comm op: reduce_scatter_tensor | [Caller Func: reduce_grads] | time (ms): 2.00 | "
                           "msg size: 2.0 KB | algbw (Gbps): ")
    assert list(log.summary()) == ["reduce_scatter_tensor | [Caller Func: reduce_grads]"]


def test_peak_flops_table(monkeypatch):
    assert peak_flops(torch.bfloat16, 100.0) == (1e14, "shardwise.peak_tflops")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peak_flops(torch.bfloat16, None)[0] is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device, dtype, want in (("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
                                ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
                                ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5e12),
                                ("NVIDIA L40S", torch.float16, 362e12),
                                ("Tesla V100-SXM2-32GB", torch.bfloat16, None),
                                ("Some New GPU", torch.bfloat16, None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=device: d)
        assert peak_flops(dtype, None)[0] == want, device


def test_shardwise_train_honours_the_sections(tmp_path, pool1):
    """`shardwise train` (one process, output not a terminal): the engine's CSV and TensorBoard monitors
    beside the run's own outputs, its train_loss equal to metrics.jsonl's loss, and plain progress lines.
    Run through the CLI's entry on the world of one of the rank pool (tests/train_cases.py), its output
    captured as a pipe would take it (not a terminal)."""
    from shardwise.train.outputs import read_metrics

    steps, out = 4, tmp_path / "run"
    ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 2},
          "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "train"},
          "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "train"}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    argv = ["--config", str(tmp_path / "ds.json"), "--model", "llama-micro", "--seq", "32", "--steps", str(steps),
            "--eval-every", "0", "--save-every", "0", "--sample-tokens", "0", "--no-export",
            "--data", str(ROOT / "data" / "sonnets.txt"), "--out", str(out)]
    [(code, stdout, stderr)] = pool1.run("train_cases:train", argv, timeout=600)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    metrics = [m for m in read_metrics(out) if m["kind"] == "train"]
    with open(tmp_path / "csv" / "train" / "Train_Samples_train_loss.csv", newline="") as f:
        rows = list(csv.reader(f))[1:]
    assert [int(x) for x, _ in rows] == [4 * (s + 1) for s in range(steps)]
    assert [float(v) for _, v in rows] == pytest.approx([m["loss"] for m in metrics], rel=1e-12)
    assert len(list((tmp_path / "tb" / "train").glob("events.out.tfevents.*"))) == 1
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # the run's own, kept
    lines = [ln for ln in stdout.splitlines() if ln.startswith("[shardwise] step ")]
    assert [ln.split(":")[0] for ln in lines] == ["[shardwise] step 2", "[shardwise] step 4"]
    assert "\r" not in stderr  # no progress bar when the output is not a terminal


def test_flops_profiler_alone_times_only_its_profile_step():
    """Each timer edge synchronizes a GPU: with only the FLOPs profiler on, phases are timed in its
    profile step and in no other; ``wall_clock_breakdown`` times every step."""
    from types import SimpleNamespace

    from shardwise.monitor import EngineMonitor
    from shardwise.monitor.timers import PhaseTimers

    mon = object.__new__(EngineMonitor)
    mon.timers, mon.wall, mon.memory, mon._step_timed = PhaseTimers(), False, False, False
    mon.profiler = SimpleNamespace(done=False, section=SimpleNamespace(profile_step=3))
    mon.engine = SimpleNamespace(global_steps=2)
    assert not mon._timed()
    mon.engine.global_steps = 3
    assert mon._timed()
    with mon.phase("fwd"):
        pass
    assert mon.timers.ms["fwd"] > 0 and mon._step_timed  # the step's elapsed times are written
    mon.profiler.done = True
    assert not mon._timed()
    mon.wall = True
    assert mon._timed()
