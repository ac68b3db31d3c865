"""NVMe offload in the estimate (``shardwise estimate --offload nvme``): what CPU offload puts on the host
goes to swap files, and the host keeps ``buffer_count`` buffers of one group each.

The host bytes of a rank with ``offload_optimizer.device: nvme`` (``nvme/``, engine stages 1-3)::

    host = buffer_count x (4 KiB + sum over the master and each optimizer state of align_4KiB(k_i x G))
           + g x Ψ/N
         ~ buffer_count x k x G + g x Ψ/N,   G = the largest group's shard = min(group elements, Ψ) / N

where ``k`` is the offloaded bytes per parameter (fp32 master + Adam moments: 12; bf16 master with bf16
states and a Kahan compensation: 8) and a group is a bucket of ``min(reduce_bucket_size,
allgather_bucket_size)`` elements at stages 1-2, a module's parameters at stage 3. The swap files hold
``k x Ψ/N`` bytes per rank. The step reads and writes every group once: ``2 x k x Ψ/N`` bytes of I/O.
``g x Ψ/N`` is the gradient shard in the master's dtype (``g`` = 4 with fp32 masters, 2 with 16-bit ones),
which stays on the host as with CPU offload (the step's gradient norm and clipping read every group's
gradient before the first group steps; on an accelerator it is a persistent pinned buffer per group):
NVMe offload does not swap gradients.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_offload_args(p: argparse.ArgumentParser, count: Callable[[str], int], size: Callable[[str], int]) -> None:
    """``--offload`` and, for ``--offload nvme``, ``--nvme-buffers``, ``--nvme-group``, ``--nvme-bandwidth``."""
    p.add_argument("--offload", choices=["none", "optimizer", "params", "nvme"], default="none",
                   help="nvme: offload_optimizer.device nvme (the host keeps --nvme-buffers buffers)")
    p.add_argument("--nvme-buffers", type=count, default=4, help="offload_optimizer.buffer_count (--offload nvme)")
    p.add_argument("--nvme-group", type=count, default=500_000_000,
                   help="elements of the largest group (min(reduce_bucket_size, allgather_bucket_size))")
    p.add_argument("--nvme-bandwidth", type=size, default=None,
                   help="the disk's bandwidth per second, e.g. 6GB: the step's I/O seconds")


def nvme_from_args(est: Any, args: argparse.Namespace) -> None:
    """:func:`apply_nvme` with the command line's flags, when ``--offload nvme``."""
    if args.offload == "nvme":
        apply_nvme(est, args.nvme_buffers, args.nvme_group, args.nvme_bandwidth)


def apply_nvme(est: Any, buffer_count: int = 4, group_elements: int = 500_000_000,
               bandwidth: float | None = None) -> Any:
    """``est`` (an optimizer-offload estimate) turned into NVMe offload's: per stage >= 1 the host bytes
    become the buffers and the former host bytes ``nvme_bytes``; a note states the formula and, with
    ``bandwidth`` (bytes/s of the disk, read and write alike), the step's I/O seconds."""
    est.offload = "nvme"
    for st in est.stages.values():
        if st.stage == 0:
            continue
        k = st.host_bytes * est.dp // max(est.psi, 1)  # offloaded bytes per parameter (rounded down)
        group = -(-min(group_elements, est.psi) // est.dp)
        st.offload, st.nvme_bytes = "nvme", st.host_bytes
        grads = (4 if est.master == "fp32" else 2) * -(-est.psi // est.dp)
        st.host_bytes = buffer_count * k * group + grads
        st.host_formula = f"{buffer_count}·{k}·G + {4 if est.master == 'fp32' else 2}Ψ/N"
        st.cluster_host_bytes = st.host_bytes * est.devices
    s1 = est.stages[1]
    note = (f"NVMe: the offloaded states ({s1.nvme_bytes / 1e9:,.2f} GB per rank at stage 1) are in swap files "
            f"under nvme_path; the host keeps {buffer_count} buffers of the largest group, G = min(group, Ψ)/N = "
            f"{-(-min(group_elements, est.psi) // est.dp):,} elements (group: {group_elements:,} elements, "
            "min(reduce_bucket_size, allgather_bucket_size) at stages 1-2); host = buffer_count·k·G + the "
            "gradient shard in the master's dtype (not swapped).")
    if bandwidth:
        note += (f" I/O per step 2·{s1.nvme_bytes / 1e9:,.2f} GB at {bandwidth / 1e9:g} GB/s: "
                 f"{2 * s1.nvme_bytes / bandwidth:,.1f} s.")
    est.notes.append(note)
    return est
