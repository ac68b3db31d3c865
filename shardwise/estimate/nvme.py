"""NVMe offload in the estimate (``shardwise estimate --offload nvme``): what CPU offload puts on the host
goes to swap files, and the host keeps ``buffer_count`` buffers of one sub-group each.

The host bytes of a rank with ``offload_optimizer.device: nvme`` (``nvme/``, engine stages 1-3), by
construction (``nvme/swapper.py``)::

    host = buffer_count x (4 KiB + sum over the master and each optimizer state of align_4KiB(k_i x S)
                           + align_4KiB(g x S))
           + [S < G] x g x G
         ~ buffer_count x (k + g) x S  (+ g x G when a group is cut into sub-groups)
    G = the largest group's shard = min(group elements, Ψ) / N,   S = min(sub_group_size, G)

where ``k`` is the offloaded bytes per parameter (fp32 master + Adam moments: 12; bf16 master with bf16
states and a Kahan compensation: 8), ``g`` the master's bytes per element (4 fp32, 2 16-bit: each buffer's
gradient slot, where a sub-group's gradient is loaded as it steps), and a group is a bucket of
``min(reduce_bucket_size, allgather_bucket_size)`` elements at stages 1-2, a module's parameters at stage 3.
No gradient shard stays on the host: the norm streams each group's gradient through one buffer, and a
group cut into sub-groups is measured in one staging buffer of its whole gradient (``g x G``: the norm is
CPU offload's to the bit only over the same whole tensor). The swap files hold ``k x Ψ/N`` bytes per rank;
the step reads and writes every one once: ``2 x k x Ψ/N`` bytes of I/O.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def base_offload(args: argparse.Namespace) -> str:
    """The estimate ``apply_nvme`` starts from: parameter offload's with ``--nvme-params``, else optimizer
    offload's (for ``--offload nvme``), else the command line's own."""
    if args.offload != "nvme":
        return args.offload
    return "params" if getattr(args, "nvme_params", False) else "optimizer"


def add_offload_args(p: argparse.ArgumentParser, count: Callable[[str], int], size: Callable[[str], int]) -> None:
    """``--offload`` and, for ``--offload nvme``, ``--nvme-buffers``, ``--nvme-group``, ``--nvme-sub-group``,
    ``--nvme-bandwidth``."""
    p.add_argument("--offload", choices=["none", "optimizer", "params", "nvme"], default="none",
                   help="nvme: offload_optimizer.device nvme (the host keeps --nvme-buffers buffers)")
    p.add_argument("--nvme-buffers", type=count, default=4, help="offload_optimizer.buffer_count (--offload nvme)")
    p.add_argument("--nvme-group", type=count, default=500_000_000,
                   help="elements of the largest group (min(reduce_bucket_size, allgather_bucket_size))")
    p.add_argument("--nvme-sub-group", type=count, default=1_000_000_000,
                   help="zero_optimization.sub_group_size: elements of one sub-group (--offload nvme)")
    p.add_argument("--nvme-bandwidth", type=size, default=None,
                   help="the disk's bandwidth per second, e.g. 6GB: the step's I/O seconds")
    add_param_args(p, count)


def nvme_from_args(est: Any, args: argparse.Namespace) -> None:
    """:func:`apply_nvme` with the command line's flags, when ``--offload nvme``."""
    if args.offload == "nvme":
        shard = param_shard_out(est) if args.nvme_params else 0
        apply_nvme(est, args.nvme_buffers, args.nvme_group, args.nvme_bandwidth, args.nvme_sub_group)
        if args.nvme_params:
            apply_nvme_params(est, shard, args.nvme_param_buffers, args.nvme_param_buffer_size,
                              args.nvme_max_in_cpu, args.nvme_group, args.nvme_bandwidth)


def apply_nvme(est: Any, buffer_count: int = 4, group_elements: int = 500_000_000,
               bandwidth: float | None = None, sub_group: int = 1_000_000_000) -> Any:
    """``est`` (an optimizer-offload estimate) turned into NVMe offload's: per stage >= 1 the host bytes
    become the buffers (and a split group's gradient staging), the former host bytes ``nvme_bytes``; a
    note states the formula and, with ``bandwidth`` (bytes/s of the disk, read and write alike), the
    step's I/O seconds."""
    est.offload = "nvme"
    group = -(-min(group_elements, est.psi) // est.dp)  # G
    piece = min(sub_group, group)  # S
    g = 4 if est.master == "fp32" else 2
    for st in est.stages.values():
        if st.stage == 0:
            continue
        k = st.host_bytes * est.dp // max(est.psi, 1)  # offloaded bytes per parameter (rounded down)
        st.offload, st.nvme_bytes = "nvme", st.host_bytes
        st.host_bytes = buffer_count * (k + g) * piece + (g * group if piece < group else 0)
        st.host_formula = f"{buffer_count}·({k}+{g})·S" + (f" + {g}·G" if piece < group else "")
        st.cluster_host_bytes = st.host_bytes * est.devices
    s1 = est.stages[1]
    note = (f"NVMe: the offloaded states ({s1.nvme_bytes / 1e9:,.2f} GB per rank at stage 1) are in swap files "
            f"under nvme_path; the host keeps {buffer_count} buffers of one sub-group, S = min(sub_group_size, G) "
            f"= {piece:,} elements, G = min(group, Ψ)/N = {group:,} (group: {group_elements:,} elements, "
            "min(reduce_bucket_size, allgather_bucket_size) at stages 1-2); host = buffer_count·(k+g)·S, each "
            "buffer a sub-group's file and its gradient (g bytes an element), + g·G (a split group's gradient, "
            "for the norm) when S < G; no gradient shard is kept on the host. The build makes each master a "
            "sub-group at a time in a buffer (never whole on the host); the first step adds one sub-group's "
            "optimizer state, (k-g)·S, while the optimizer makes it.")
    if bandwidth:
        note += (f" I/O per step 2·{s1.nvme_bytes / 1e9:,.2f} GB at {bandwidth / 1e9:g} GB/s: "
                 f"{2 * s1.nvme_bytes / bandwidth:,.1f} s.")
    est.notes.append(note)
    return est


# -- parameters on NVMe (offload_param.device: nvme, stage 3) ---------------------------------------------
def add_param_args(p: argparse.ArgumentParser, count: Callable[[str], int]) -> None:
    """``--nvme-params`` and its ``offload_param`` keys (DeepSpeed's defaults)."""
    p.add_argument("--nvme-params", action="store_true",
                   help="with --offload nvme: offload_param.device nvme too (stage 3)")
    p.add_argument("--nvme-param-buffers", type=count, default=5, help="offload_param.buffer_count")
    p.add_argument("--nvme-param-buffer-size", type=count, default=100_000_000,
                   help="offload_param.buffer_size (elements)")
    p.add_argument("--nvme-max-in-cpu", type=_count_or_zero(count), default=1_000_000_000,
                   help="offload_param.max_in_cpu (elements of shards kept in host memory; 0: none)")


def _count_or_zero(count: Callable[[str], int]) -> Callable[[str], int]:
    """``count`` (1e9, 500M) that also takes 0 (``max_in_cpu: 0``: every shard on disk)."""
    def conv(text: str) -> int:
        return 0 if text.strip() in ("0", "0.0") else count(text)
    conv.__name__ = "count"
    return conv


def check_nvme_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--nvme-params`` goes with ``--offload nvme`` (else it would change nothing: refused, exit 2)."""
    if args.nvme_params and args.offload != "nvme":
        p.error(f"--nvme-params goes with --offload nvme (got --offload {args.offload})")


def param_shard_out(est: Any) -> int:
    """Stage 3 of a parameter-offload ``est``: the parameter shard's host bytes taken out (returned), so
    that :func:`apply_nvme` sees the optimizer's bytes alone."""
    st = est.stages[3]
    shard = (4 if est.dtype == "fp32" else 2) * -(-est.psi // est.dp)
    st.host_bytes -= shard
    return shard


def apply_nvme_params(est: Any, shard: int, buffer_count: int = 5, buffer_size: int = 100_000_000,
                      max_in_cpu: int = 1_000_000_000, group_elements: int = 500_000_000,
                      bandwidth: float | None = None) -> Any:
    """Stage 3 with the parameter shard (``shard`` bytes a rank) in swap files: the host keeps the first
    ``max_in_cpu`` elements of shards and ``buffer_count`` bounce buffers of ``min(buffer_size, G)``
    elements (``nvme/param_store.py``); the rest is on disk. Read at every gather (a forward and a
    backward per micro-batch), written once per optimizer step."""
    st = est.stages[3]
    el = 4 if est.dtype == "fp32" else 2
    group = -(-min(group_elements, est.psi) // est.dp)
    in_cpu = min(max_in_cpu, shard // el) * el
    buffers = max(1, buffer_count) * min(buffer_size, group) * el
    on_disk = shard - in_cpu
    st.host_bytes += in_cpu + buffers
    st.nvme_bytes += on_disk
    st.host_formula += f" + {max(1, buffer_count)}·{el}·min(buffer_size, G) + {el}·min(max_in_cpu, Ψ/N)"
    st.cluster_host_bytes = st.host_bytes * est.devices
    st.offload = "nvme+params"
    note = (f"NVMe parameters (stage 3): {on_disk / 1e9:,.2f} GB of the {el}-byte parameter shard in swap files "
            f"(max_in_cpu {max_in_cpu:,} elements, {in_cpu / 1e9:,.2f} GB, stay in host memory); the host adds "
            f"{max(1, buffer_count)} bounce buffers of min(buffer_size {buffer_size:,}, G {group:,}) elements = "
            f"{buffers / 1e9:,.2f} GB.")
    if bandwidth:
        note += (f" Parameter I/O: 2·{on_disk / 1e9:,.2f} GB read per micro-batch (forward and backward "
                 f"gathers), {on_disk / 1e9:,.2f} GB written per step: {2 * on_disk / bandwidth:,.1f} s + "
                 f"{on_disk / bandwidth:,.1f} s at {bandwidth / 1e9:g} GB/s.")
    est.notes.append(note)
    return est
