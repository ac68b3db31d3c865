"""NVMe offload (ZeRO-Infinity's optimizer tier) measured against the disk it runs on and against CPU offload.

    python benchmarks/offload/bench_nvme.py --nvme-path /mnt/nvme          # the measurement
    python benchmarks/offload/bench_nvme.py --nvme-path /tmp --smoke       # tiny sizes
    python benchmarks/offload/bench_nvme.py --nvme-path /mnt/nvme --params # ZeRO-3 parameters, CPU vs NVMe
    python benchmarks/offload/bench_nvme.py --nvme-path /mnt/nvme --build-only  # the build's RSS peak only
    shardwise launch --nproc 2 benchmarks/offload/bench_nvme.py --child nvme --params --nvme-path /mnt/nvme
                                                                            # one mode at two ranks: a RESULT line each

1. **The disk**: sequential write then read of ``--disk-mib`` MiB in one file through shardwise's I/O engine
   (``shardwise.aio``: O_DIRECT where the filesystem takes it, so the page cache is not measured), with the
   run's ``aio`` settings; the best of 3 each.
2. **The step**: a Llama (``--hidden``, ``--layers``) trained by the engine at ``--stage`` with bf16 compute
   and ``offload_optimizer`` on the CPU, then on NVMe (``pipeline_read``/``pipeline_write``,
   ``--buffers`` buffers), each in a fresh process: seconds per step (median after a warm-up), the
   process's peak RSS (``ru_maxrss``), the bytes the step read and wrote and the seconds the transfers took
   (I/O bandwidth achieved, against the disk's), and the losses (equal to the bit, or the run fails).

The step's floor with NVMe is ``max(CPU-offload step, bytes read / read bandwidth + bytes written / write
bandwidth)`` when nothing overlaps the transfers but each other, and the goal 1.3x the CPU-offload step is
reachable only where that I/O time is under 1.3x the CPU-offload step: the table says which. Prints a markdown
table and writes JSON (``--out``) with the machine, date and command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def disk_bandwidth(folder: Path, mib: int, threads: int) -> dict:
    """Best-of-3 sequential write and read bandwidth (bytes/s) of one ``mib`` MiB file in ``folder``."""
    from shardwise.aio import AioConfig, AlignedBuffer, IOEngine, open_file

    buf = AlignedBuffer(mib << 20)
    buf.tensor.random_(0, 256)
    path = folder / f"bench-nvme-{os.getpid()}.bin"
    out = {"write": 0.0, "read": 0.0}
    with IOEngine(AioConfig(intra_op_parallelism=threads)) as io:
        f = open_file(path)
        try:
            out["direct"] = f.direct
            for _ in range(3):
                t0 = time.perf_counter()
                io.write(f, buf.tensor).wait()
                os.fsync(f.fd)
                out["write"] = max(out["write"], buf.nbytes / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                io.read(f, buf.tensor).wait()
                out["read"] = max(out["read"], buf.nbytes / (time.perf_counter() - t0))
        finally:
            f.close()
            path.unlink()
    return out


def _config(args, device: str, nvme_path: str) -> dict:
    if args.params:  # parameters on ``device`` at stage 3, the optimizer on the CPU in both runs
        return _param_config(args, device, nvme_path)
    oo = {"device": device}
    if device == "nvme":
        oo.update(nvme_path=nvme_path, buffer_count=args.buffers, pipeline_read=True, pipeline_write=True)
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "steps_per_print": 0,
            "bf16": {"enabled": True}, "aio": {"intra_op_parallelism": args.threads},
            "zero_optimization": {"stage": args.stage, "sub_group_size": args.sub_group,
                                  "reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket,
                                  "offload_optimizer": oo},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}


def _vm(field: str) -> int:
    """``/proc/self/status``'s ``field`` in bytes (VmHWM: the peak resident set since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: ``5`` into ``/proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def child(args) -> None:
    """One training run in this process; prints one JSON line."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import shardwise

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                      num_key_value_heads=max(1, args.hidden // 64), max_position_embeddings=args.seq)
    model = AutoModelForCausalLM.from_config(cfg)
    if args.param_read_then_gather:  # several ranks: the read on the reader thread, the all-gather at the wait
        from shardwise.nvme import NvmeParamStore

        NvmeParamStore.reads_ahead_of_gather = True
    model_rss = _vm("VmRSS")  # the model alone (fp32, as from_config makes it)
    _reset_peak()  # from here VmHWM is the build's peak
    engine, *_ = shardwise.initialize(model=model, config=_config(args, args.child, args.nvme_path))
    built_rss = _vm("VmHWM")  # the build's peak (with NVMe offload: the buffers, no master made whole)
    if args.build_only:
        out = {"model_rss": model_rss, "built_rss": built_rss, "after_build_rss": _vm("VmRSS"),
               "params": sum(p.numel() for p in model.parameters()), "report": dict(engine.memory_report())}
        engine.destroy()
        print("RESULT " + json.dumps(out), flush=True)
        return
    _reset_peak()  # from here VmHWM is the peak while training
    ids = torch.randint(0, args.vocab, (args.steps, args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    times, losses, io0 = [], [], None
    for s in range(args.steps):
        if s == 1 and engine.nvme_params is not None:  # after the warm-up step
            io0 = _param_counters(engine.nvme_params)
        elif s == 1 and engine.nvme is not None:
            io = engine.nvme.io
            io0 = (io.bytes_read, io.bytes_written, io.seconds_read, io.seconds_written, io.busy["any"])
        t0 = time.perf_counter()
        loss = engine(input_ids=ids[s], labels=ids[s]).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    out = {"step_s": statistics.median(times[1:]), "losses": losses,
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "built_rss": built_rss, "train_peak_rss": _vm("VmHWM"),
           "params": sum(p.numel() for p in model.parameters()), "report": dict(engine.memory_report())}
    if engine.nvme_params is not None:
        out.update(_param_io(engine.nvme_params, io0, args.steps - 1))
    if engine.nvme is not None:
        io, n = engine.nvme.io, args.steps - 1
        out.update(read_bytes=(io.bytes_read - io0[0]) / n, write_bytes=(io.bytes_written - io0[1]) / n,
                   read_s=(io.seconds_read - io0[2]) / n, write_s=(io.seconds_written - io0[3]) / n,
                   busy_s=(io.busy["any"] - io0[4]) / n)
    engine.destroy()
    print("RESULT " + json.dumps(out), flush=True)


# -- parameters on NVMe (--params) ---------------------------------------------------------------------
def _param_config(args, device: str, nvme_path: str) -> dict:
    """Stage 3, every group sharded (persistence threshold 0), ``offload_param`` on ``device`` (NVMe:
    ``--buffers`` bounce buffers of ``--param-buffer-size`` elements, ``max_in_cpu`` 0: every shard on disk)."""
    op = {"device": device}
    if device == "nvme":
        op.update(nvme_path=nvme_path, buffer_count=args.buffers, buffer_size=args.param_buffer_size, max_in_cpu=0)
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "steps_per_print": 0,
            "bf16": {"enabled": True}, "aio": {"intra_op_parallelism": args.threads},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_param": op, "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}


def _param_counters(swap) -> tuple:
    io = swap.io
    return (io.bytes_read, io.bytes_written, io.busy["read"], io.busy["write"], io.busy["any"],
            swap.waits["read_wait"], swap.waits["reads"], swap.waits["ahead"], swap.waits["write"])


def _param_io(swap, io0: tuple, n: int) -> dict:
    """Per step since ``io0``: bytes read / written, seconds reads / writes were in flight, seconds the
    gathers waited for reads, reads made ahead (of all reads), seconds the step's writes took."""
    d = [(b - a) / n for a, b in zip(io0, _param_counters(swap), strict=True)]
    return {"read_bytes": d[0], "write_bytes": d[1], "read_s": d[2], "write_s": d[3], "busy_s": d[4],
            "read_wait_s": d[5], "reads": d[6], "ahead": d[7], "write_wait_s": d[8],
            "param_disk_bytes": swap.disk_bytes()}


def _param_table(disk: dict, cpu: dict, nvme: dict) -> list[str]:
    gb = 1e9
    rd_bw = nvme["read_bytes"] / nvme["read_s"] if nvme["read_s"] else 0.0
    wr_bw = nvme["write_bytes"] / nvme["write_s"] if nvme["write_s"] else 0.0
    io_floor = nvme["read_bytes"] / disk["read"] + nvme["write_bytes"] / disk["write"]
    hidden = 1 - nvme["read_wait_s"] / nvme["read_s"] if nvme["read_s"] else 0.0
    return [
        "| figure (ZeRO-3, parameters on CPU / on NVMe, optimizer on CPU) | value |", "| --- | --- |",
        f"| disk sequential write / read (O_DIRECT: {disk['direct']}) | {disk['write'] / gb:.2f} / "
        f"{disk['read'] / gb:.2f} GB/s |",
        f"| parameters in swap files | {nvme['param_disk_bytes'] / gb:.3f} GB |",
        f"| parameter I/O per step: read / written | {nvme['read_bytes'] / gb:.3f} / "
        f"{nvme['write_bytes'] / gb:.3f} GB |",
        f"| parameter I/O bandwidth: read / write | {rd_bw / gb:.2f} / {wr_bw / gb:.2f} GB/s "
        f"({rd_bw / disk['read']:.0%} / {wr_bw / disk['write']:.0%} of the disk's) |",
        f"| the step's parameter I/O at the disk's bandwidth | {io_floor:.3f} s |",
        f"| reads per step: made ahead (prefetch) / all | {nvme['ahead']:.0f} / {nvme['reads']:.0f} |",
        f"| seconds reads were in flight / the gathers waited for them | {nvme['read_s']:.3f} / "
        f"{nvme['read_wait_s']:.3f} s: {hidden:.0%} of the read time hidden behind compute |",
        f"| seconds the stepping thread spent handing the writes over (a host copy, a wait for one of "
        f"buffer_count write slots) | {nvme['write_wait_s']:.3f} s |",
        f"| step, parameters on CPU / on NVMe | {cpu['step_s']:.3f} / {nvme['step_s']:.3f} s "
        f"({nvme['step_s'] / cpu['step_s']:.2f}x) |",
        f"| peak RSS, parameters on CPU / on NVMe | {cpu['peak_rss'] / gb:.3f} / {nvme['peak_rss'] / gb:.3f} GB |",
        f"| NVMe parameter bounce buffers | {nvme['report'].get('nvme_param_buffers', 0) / gb:.3f} GB |",
        f"| losses equal to the bit | {cpu['losses'] == nvme['losses']} |",
    ]


def _run(args, device: str) -> dict:
    cmd = [sys.executable, __file__, "--child", device, *sys.argv[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"the {device} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def _table(disk: dict, cpu: dict, nvme: dict) -> list[str]:
    gb = 1e9
    rd_bw = nvme["read_bytes"] / nvme["read_s"] if nvme["read_s"] else 0.0
    wr_bw = nvme["write_bytes"] / nvme["write_s"] if nvme["write_s"] else 0.0
    io_floor = nvme["read_bytes"] / disk["read"] + nvme["write_bytes"] / disk["write"]
    busy = nvme["busy_s"]
    best = min(cpu.get("step_s_rounds", [cpu["step_s"]]))  # the least loaded CPU-offload run: the reference
    floor = max(best, io_floor)
    verdict = "reachable" if floor <= 1.3 * best else "out of reach on this disk"
    return [
        "| figure | value |", "| --- | --- |",
        f"| disk sequential write / read (O_DIRECT: {disk['direct']}) | {disk['write'] / gb:.2f} / "
        f"{disk['read'] / gb:.2f} GB/s |",
        f"| step's I/O: read / written per step | {nvme['read_bytes'] / gb:.3f} / {nvme['write_bytes'] / gb:.3f} GB |",
        f"| step's I/O bandwidth: read / write | {rd_bw / gb:.2f} / {wr_bw / gb:.2f} GB/s "
        f"({rd_bw / disk['read']:.0%} / {wr_bw / disk['write']:.0%} of the disk's) |",
        f"| disk busy per step (a transfer in flight) / its time at the measured bandwidths | {busy:.3f} / "
        f"{io_floor:.3f} s: the step's I/O at {io_floor / busy:.0%} of the disk's bandwidth |",
        f"| step, CPU offload / NVMe offload (median of {len(cpu.get('step_s_rounds', [1]))} alternate runs) | "
        f"{cpu['step_s']:.3f} / {nvme['step_s']:.3f} s ({nvme['step_s'] / cpu['step_s']:.2f}x) |",
        f"| overlap: CPU step + disk busy - NVMe step (the transfers' time run beside compute) | "
        f"{max(0.0, cpu['step_s'] + busy - nvme['step_s']):.3f} s of {min(cpu['step_s'], busy):.3f} s possible |",
        f"| NVMe step floor: max(fastest CPU step {best:.3f} s, I/O at the disk's bandwidth {io_floor:.3f} s) | "
        f"{floor:.3f} s ({floor / best:.2f}x: the 1.3x goal is {verdict}) |",
        f"| peak RSS, CPU offload / NVMe offload | {cpu['peak_rss'] / gb:.3f} / {nvme['peak_rss'] / gb:.3f} GB |",
        f"| peak RSS while training (after the build), CPU offload / NVMe offload | "
        f"{cpu['train_peak_rss'] / gb:.3f} / {nvme['train_peak_rss'] / gb:.3f} GB |",
        f"| RSS peak of the build, CPU offload / NVMe offload | {cpu['built_rss'] / gb:.3f} / "
        f"{nvme['built_rss'] / gb:.3f} GB |",
        f"| offloaded master + states (on disk with NVMe) | {nvme['report'].get('nvme_offloaded', 0) / gb:.3f} GB |",
        f"| NVMe host buffers | {nvme['report'].get('nvme_buffers', 0) / gb:.3f} GB |",
        f"| losses equal to the bit | {cpu['losses'] == nvme['losses']} |",
    ]


def _build_table(cpu: dict, nvme: dict) -> list[str]:
    """``--build-only``: the build's RSS peak over the model's RSS, CPU offload against NVMe offload."""
    gb = 1e9
    rows = ["| figure | CPU offload | NVMe offload |", "| --- | ---: | ---: |"]
    for name, key in (("RSS of the model alone (before initialize)", "model_rss"),
                      ("RSS peak of the build", "built_rss"), ("RSS after the build", "after_build_rss")):
        rows.append(f"| {name} | {cpu[key] / gb:.3f} GB | {nvme[key] / gb:.3f} GB |")
    rows.append(f"| the build's peak over the model | {(cpu['built_rss'] - cpu['model_rss']) / gb:.3f} GB | "
                f"{(nvme['built_rss'] - nvme['model_rss']) / gb:.3f} GB |")
    rows.append(f"| master + states (host / in swap files), NVMe buffers | "
                f"{(cpu['report']['master_params'] + cpu['report']['optimizer_states']) / gb:.3f} GB | "
                f"{nvme['report'].get('nvme_offloaded', 0) / gb:.3f} GB, "
                f"{nvme['report'].get('nvme_buffers', 0) / gb:.3f} GB |")
    return rows


def _rounds(args) -> tuple[dict, dict]:
    """CPU offload and NVMe offload, alternately ``--rounds`` times (a shared machine's load moves between
    runs): each mode's last run, with ``step_s`` the median over the rounds and ``step_s_rounds`` all."""
    runs: dict[str, list[dict]] = {"cpu": [], "nvme": []}
    for _ in range(args.rounds):
        for device in runs:
            runs[device].append(_run(args, device))
    out = []
    for rs in runs.values():
        last = dict(rs[-1])
        if args.build_only:
            last["built_rss_rounds"] = [r["built_rss"] for r in rs]
            out.append(last)
            continue
        last["step_s_rounds"] = [r["step_s"] for r in rs]
        last["step_s"] = statistics.median(last["step_s_rounds"])
        out.append(last)
    return out[0], out[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--bucket", type=int, default=10_000_000)
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--sub-group", type=int, default=1_000_000_000, help="zero_optimization.sub_group_size")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--disk-mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=1, help="CPU then NVMe runs, alternately, this many times")
    p.add_argument("--smoke", action="store_true", help="tiny sizes")
    p.add_argument("--out", default=None)
    p.add_argument("--params", action="store_true",
                   help="stage 3 with offload_param on the CPU, then on NVMe (the optimizer on the CPU in both)")
    p.add_argument("--param-buffer-size", type=int, default=100_000_000, help="offload_param.buffer_size")
    p.add_argument("--param-read-then-gather", action="store_true",
                   help="several ranks: read a prefetched shard on the reader thread and all-gather it when "
                        "waited for (NvmeParamStore.reads_ahead_of_gather), against the default")
    p.add_argument("--build-only", action="store_true",
                   help="only build each engine: the build's RSS peak, CPU offload against NVMe offload")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.disk_mib, args.steps, args.bucket = 64, 2, 512, 16, 3, 20_000
    if args.child:
        child(args)
        return
    disk = {} if args.build_only else disk_bandwidth(Path(args.nvme_path), args.disk_mib, args.threads)
    cpu, nvme = _rounds(args)
    if cpu.get("losses") != nvme.get("losses"):
        raise SystemExit(f"losses differ: CPU offload {cpu['losses']}, NVMe {nvme['losses']}")
    lines = _build_table(cpu, nvme) if args.build_only else (_param_table if args.params else _table)(disk, cpu, nvme)
    print("\n".join(lines))
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": platform.platform(), "cpus": os.cpu_count(), "command": " ".join(sys.argv),
              "disk": disk, "cpu_offload": cpu, "nvme_offload": nvme, "table": lines}
    out = Path(args.out) if args.out else Path(tempfile.gettempdir()) / "bench_nvme.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
