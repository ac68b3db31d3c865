"""The largest model each offload mode can fully fine-tune on one GPU + host + disk, from the estimator.

    python benchmarks/offload/largest_model.py --device-memory 141GB --host-memory 128GiB --disk-bw 7GB

For each mode (bf16 compute, AdamW; fp32 masters, or bf16 masters with bf16 states and a Kahan
compensation), a binary search over the parameter count for the largest model whose model states fit:
device bytes (``shardwise.estimate``'s stage-3 figure, one device) at most the device memory less the
estimator's margin, and host bytes at most ``--host-fraction`` of the host memory. Host bytes are the
estimator's (``--offload nvme``: ``estimate/nvme.py``'s buffers, plus the first step's one piece of optimizer
state, ``(k - g) x S``, made by the optimizer before it is copied into a buffer; the build makes each master
a piece at a time in a buffer, so it adds nothing) and, for CPU offload, the gradient shard in the
master's dtype too (shardwise keeps it on the host there). NVMe
parameter offload (``max_in_cpu`` 0): the device bytes of CPU parameter offload, the host bytes of NVMe
optimizer offload plus the parameters' bounce buffers (DeepSpeed's defaults: 5 x 1e8 elements), and the
16-bit parameters on disk too.
Activations are not counted: they need what the margin leaves. The NVMe step's I/O is ``2 x k x Ψ /
disk bandwidth`` (read and write every state once). Prints a markdown table.
"""

from __future__ import annotations

import argparse

from shardwise.estimate.memory import MARGIN, estimate, parse_bytes
from shardwise.estimate.nvme import apply_nvme

MODES = [  # name, offload, master, parameters offloaded too
    ("no offload, fp32 master", "none", "fp32"), ("no offload, bf16 states", "none", "states"),
    ("CPU optimizer offload, fp32 master", "optimizer", "fp32"),
    ("CPU optimizer offload, bf16 states", "optimizer", "states"),
    ("CPU optimizer + parameter offload, bf16 states", "params", "states"),
    ("NVMe optimizer offload, fp32 master", "nvme", "fp32"), ("NVMe optimizer offload, bf16 states", "nvme", "states"),
    ("NVMe optimizer + NVMe parameter offload, bf16 states", "nvme+params", "states"),
]
PARAM_BOUNCE = 5 * 100_000_000 * 2  # offload_param's default buffer_count x buffer_size x 2 bytes


def need(params: int, offload: str, master: str, buffers: int, group: int) -> tuple[int, int, int]:
    """(device bytes, host bytes, bytes on disk) of the model states at stage 3 on one device."""
    if offload == "nvme+params":  # the device figure of parameter offload; parameters and states on disk
        dev = estimate(params, 1, dtype="bf16", offload="params", master=master).stages[3].resident_bytes
        est = apply_nvme(estimate(params, 1, dtype="bf16", offload="optimizer", master=master), buffers, group)
        host = est.stages[3].host_bytes + PARAM_BOUNCE + first_step(est, params, master, group)
        return dev, host, est.stages[3].nvme_bytes + 2 * params
    est = estimate(params, 1, dtype="bf16", offload="optimizer" if offload == "nvme" else offload, master=master)
    if offload == "nvme":
        apply_nvme(est, buffers, group)
    st = est.stages[3]
    host = st.host_bytes + ((4 if master == "fp32" else 2) * params if offload in ("optimizer", "params") else 0)
    if offload == "nvme":
        host += first_step(est, params, master, group)
    return st.resident_bytes, host, st.nvme_bytes


def first_step(est, params: int, master: str, group: int) -> int:
    """NVMe: the first step's transient, one piece's optimizer state (``k - g`` bytes an element: Adam's
    moments) that the optimizer makes before it is copied into the piece's buffer (no sub_group_size cut
    here: a piece is a group, at most ``group`` elements)."""
    k = est.stages[3].nvme_bytes // max(params, 1)
    return (k - (4 if master == "fp32" else 2)) * min(group, params)


def largest(offload: str, master: str, device: int, host: int, buffers: int, group: int) -> int:
    lo, hi = 0, 10**13
    while hi - lo > 10**7:
        mid = (lo + hi) // 2
        dev, h, _ = need(mid, offload, master, buffers, group)
        lo, hi = (mid, hi) if dev <= device * (1 - MARGIN) and h <= host else (lo, mid)
    return lo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device-memory", default="141GB")
    p.add_argument("--host-memory", default="128GiB")
    p.add_argument("--host-fraction", type=float, default=0.85, help="of the host memory, for model states")
    p.add_argument("--disk-bw", default="7GB", help="the disk's read and write bandwidth per second")
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--group", type=int, default=100_000_000, help="elements of the largest group (bucket)")
    a = p.parse_args()
    device, host, bw = parse_bytes(a.device_memory), parse_bytes(a.host_memory), parse_bytes(a.disk_bw)
    print(f"One GPU of {a.device_memory} ({1 - MARGIN:.0%} usable), host {a.host_memory} ({a.host_fraction:.0%} for "
          f"model states), disk {a.disk_bw}/s; bf16 compute, AdamW, stage 3; activations not counted\n")
    print("| mode | largest model | device GB | host GB | on disk GB | step's disk I/O |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, offload, master in MODES:
        n = largest(offload, master, device, int(host * a.host_fraction), a.buffers, a.group)
        dev, h, disk = need(n, offload, master, a.buffers, a.group)
        io = f"{2 * disk / bw:.1f} s" if disk else "-"
        print(f"| {name} | {n / 1e9:.1f}B | {dev / 1e9:.1f} | {h / 1e9:.1f} | {disk / 1e9:.1f} | {io} |")


if __name__ == "__main__":
    main()
