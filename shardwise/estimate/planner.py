"""Step-time planner: which layout trains fastest on a given cluster, and why.

The memory estimator (``estimate/memory.py``) says what fits; this says what it costs in time. Every
collective is priced with the alpha-beta (latency-bandwidth) model of a ring: an all-gather or
reduce-scatter of a buffer of ``B`` bytes over ``n`` ranks takes ``(n-1)·(α + B/n/β)`` and an
all-reduce twice that (reduce-scatter + all-gather), where ``β`` is the bandwidth of the slowest
link the ring crosses: a group whose ranks sit in one node uses ``--intra-bw``, one that spans
nodes ``--inter-bw``. Ranks are placed tensor-parallel innermost, then the shard group, then the
replicas (as ``layout/grid.py`` does), so TP and small shard groups stay inside a node.

Per step, per rank (Ψ = params / tp, e = bytes per element, k = shard group, r = dp / k):

* stage 0: all-reduce of the gradients (Ψe) over all dp ranks;
* stages 1-2: reduce-scatter of the gradients (Ψe) and all-gather of the updated parameters (Ψe)
  inside the shard group, all-reduce of the gradient shard (Ψe/k) across the r replicas;
* stage 3: the same, plus a second all-gather (forward and backward each gather the parameters);
* ``hpz`` (ZeRO++): stage 3 whose primary shards span all dp ranks, with a secondary copy of the
  parameters sharded inside the node, so only the backward all-gather stays local;
* quantized weights (qwZ) all-gather int8 plus one fp32 scale per 256 elements; quantized
  gradients (qgZ) reduce-scatter int8 or int4 the same way;
* TP: four all-reduces of the activations (b·s·h·e) per layer, two in forward, two in backward.

Compute is 6·params·tokens FLOPs (8 with activation checkpointing) split over the TP ranks, at
``--tflops`` achieved per device. Data-parallel traffic overlaps compute phase by phase (forward
gathers with the forward third, backward gathers and gradient reductions with the backward two
thirds); TP all-reduces sit on the critical path and never overlap.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

from shardwise.estimate.memory import ModelFacts, model_state_bytes, working_bytes

QUANT_BLOCK = 256  # elements per fp32 scale in quantized collectives


@dataclass(frozen=True)
class Cluster:
    """Links and compute of one cluster; bandwidths are bytes/s per device."""

    nodes: int
    gpus_per_node: int
    intra_bw: float
    inter_bw: float
    latency: float
    tflops: float

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Layout:
    """One way to lay a model out on the cluster."""

    stage: int
    tp: int
    shard: int  # ranks one shard group spans (k); dp means plain ZeRO, 1 means DDP
    hybrid: str = "hsdp"  # "hsdp" (MiCS / FSDP2 HSDP) or "hpz" (ZeRO++ secondary partition)
    quant_weights: bool = False
    grad_bits: int = 16  # 16 (none), 8 or 4

    def describe(self) -> str:
        q = [x for x, on in (("qwZ", self.quant_weights), (f"qgZ{self.grad_bits}", self.grad_bits < 16)) if on]
        return f"stage {self.stage}, tp {self.tp}, {self.hybrid} k={self.shard}" + (f", {'+'.join(q)}" if q else "")


@dataclass
class Collective:
    name: str
    kind: str  # all_gather | reduce_scatter | all_reduce
    nbytes: float  # size of the full (unsharded) buffer
    group: int
    crosses_nodes: bool
    seconds: float
    sent_bytes: float  # what this rank sends: (n-1)/n of the buffer (2x for an all-reduce)
    phase: str  # forward | backward | critical


@dataclass
class Plan:
    layout: Layout
    compute_s: float
    collectives: list[Collective]
    exposed_comm_s: float
    step_s: float
    tokens_per_s: float
    device_bytes: int
    fits: bool
    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ring_seconds(kind: str, nbytes: float, n: int, bw: float, latency: float,
                 reduce_bw: float = float("inf")) -> float:
    """Alpha-beta-gamma time of one ring collective over ``n`` ranks on a buffer of ``nbytes``.

    ``reduce_bw`` prices the additions a reduce-scatter (and the first half of an all-reduce)
    makes on each received chunk; on GPUs it is HBM-fast and negligible, on CPUs it is not.
    """
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    adds = (n - 1) * nbytes / n / reduce_bw if kind in ("reduce_scatter", "all_reduce") else 0.0
    return steps * (latency + nbytes / n / bw) + adds


def _collective(c: Cluster, name: str, kind: str, nbytes: float, stride: int, size: int,
                phase: str) -> Collective:
    """Price one collective over a group of ``size`` ranks ``stride`` apart."""
    crosses = stride * size > c.gpus_per_node
    bw = c.inter_bw if crosses else c.intra_bw
    sent = nbytes * (size - 1) / size * (2 if kind == "all_reduce" else 1)
    return Collective(name, kind, nbytes, size, crosses, ring_seconds(kind, nbytes, size, bw, c.latency),
                      sent, phase)


def _wire_bytes(elements: float, bits: int) -> float:
    """Bytes on the wire for ``elements`` at ``bits`` (quantized: plus one fp32 scale per block)."""
    return elements * bits / 8 + (4 * elements / QUANT_BLOCK if bits < 16 else 0)


def _dp_collectives(c: Cluster, lay: Layout, psi: float, el: int) -> list[Collective]:
    """The data-parallel traffic of one step (see the module docstring)."""
    dp = c.devices // lay.tp
    t, k = lay.tp, lay.shard
    if lay.stage == 0:
        return [_collective(c, "grad all-reduce", "all_reduce", psi * el, t, dp, "backward")]
    wbits = 8 if lay.quant_weights else el * 8
    gbits = min(lay.grad_bits, el * 8)
    if lay.hybrid == "hpz" and lay.stage == 3:  # primary shards over all dp, secondary inside k
        return [_collective(c, "param all-gather (fwd)", "all_gather", _wire_bytes(psi, wbits), t, dp, "forward"),
                _collective(c, "param all-gather (bwd, secondary)", "all_gather", psi * el, t, k, "backward"),
                _collective(c, "grad reduce-scatter", "reduce_scatter", _wire_bytes(psi, gbits), t, dp,
                            "backward")]
    out = []
    if lay.stage == 3:
        out.append(_collective(c, "param all-gather (fwd)", "all_gather", _wire_bytes(psi, wbits), t, k, "forward"))
        out.append(_collective(c, "param all-gather (bwd)", "all_gather", _wire_bytes(psi, wbits), t, k, "backward"))
    else:  # stages 1-2: updated shards all-gathered after the step, overlapping the next forward
        out.append(_collective(c, "param all-gather", "all_gather", psi * el, t, k, "forward"))
    out.append(_collective(c, "grad reduce-scatter", "reduce_scatter", _wire_bytes(psi, gbits), t, k, "backward"))
    if dp // k > 1:
        out.append(_collective(c, "grad shard all-reduce (replicas)", "all_reduce", psi * el / k, t * k,
                               dp // k, "backward"))
    return out


def _tp_collectives(c: Cluster, lay: Layout, facts: ModelFacts | None, tokens: int, el: int) -> list[Collective]:
    if lay.tp == 1 or facts is None:
        return []
    act = tokens * facts.hidden_size * el
    one = _collective(c, "TP activation all-reduce", "all_reduce", act, 1, lay.tp, "critical")
    n = 4 * facts.num_layers
    return [Collective(f"{one.name} x{n}", one.kind, act * n, one.group, one.crosses_nodes, one.seconds * n,
                       one.sent_bytes * n, "critical")]


def _device_bytes(params: int, c: Cluster, lay: Layout, dtype: str, facts: ModelFacts | None,
                  micro_batch: int | None, seq: int | None, ckpt: bool) -> int:
    psi = -(-params // lay.tp)
    dp = c.devices // lay.tp
    n = dp if (lay.hybrid == "hpz" or lay.stage == 0) else lay.shard
    dev = model_state_bytes(psi, n, dtype, lay.stage, "none")[0]
    if lay.hybrid == "hpz" and lay.stage == 3:
        dev += -(-psi // lay.shard) * (4 if dtype == "fp32" else 2)  # the secondary parameter shard
    return dev + working_bytes(facts, lay.tp, dtype, micro_batch, seq, ckpt, lay.stage)


def evaluate(params: int, c: Cluster, lay: Layout, *, dtype: str = "bf16", facts: ModelFacts | None = None,
             micro_batch: int = 1, seq: int = 2048, activation_checkpointing: bool = False,
             device_memory: int | None = None) -> Plan:
    """Predicted step time, traffic per link and memory of ``lay`` on cluster ``c``."""
    el = 4 if dtype == "fp32" else 2
    tokens = micro_batch * seq
    flops = (8 if activation_checkpointing else 6) * params * tokens / lay.tp
    compute = flops / (c.tflops * 1e12)
    colls = _dp_collectives(c, lay, params / lay.tp, el) + _tp_collectives(c, lay, facts, tokens, el)
    phase = {p: sum(x.seconds for x in colls if x.phase == p) for p in ("forward", "backward", "critical")}
    exposed = (phase["critical"] + max(0.0, phase["forward"] - compute / 3)
               + max(0.0, phase["backward"] - 2 * compute / 3))
    step = compute + exposed
    dev = _device_bytes(params, c, lay, dtype, facts, micro_batch, seq, activation_checkpointing)
    dp = c.devices // lay.tp
    return Plan(lay, compute, colls, exposed, step, tokens * dp / step, dev,
                device_memory is None or dev <= device_memory,
                intra_bytes=sum(x.sent_bytes for x in colls if not x.crosses_nodes),
                inter_bytes=sum(x.sent_bytes for x in colls if x.crosses_nodes))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(c: Cluster, facts: ModelFacts | None = None) -> list[Layout]:
    """Every layout worth pricing: stages, TP inside a node, shard sizes, hybrid kind, quantization."""
    heads = facts.num_heads if facts else 0
    tps = [t for t in _divisors(c.gpus_per_node) if facts is not None or t == 1]
    out = []
    for tp in tps:
        if heads and heads % tp:
            continue
        dp = c.devices // tp
        out.append(Layout(0, tp, 1))
        for stage, k in itertools.product((1, 2, 3), _divisors(dp)):
            if k == 1 and dp > 1:
                continue  # a shard group of one is stage 0
            for qw, gb in itertools.product((False, True) if stage == 3 else (False,), (16, 8, 4)):
                out.append(Layout(stage, tp, k, "hsdp", qw, gb))
                if stage == 3 and 1 < k < dp:
                    out.append(Layout(stage, tp, k, "hpz", qw, gb))
    return out


def plan(params: int, c: Cluster, **kw: Any) -> list[Plan]:
    """Every layout priced, fastest first; layouts that fit ``device_memory`` before those that do not.

    Ties go to the layout that changes the numbers least: unquantized collectives, then lower stages.
    """
    plans = [evaluate(params, c, lay, **kw) for lay in layouts(c, kw.get("facts"))]
    return sorted(plans, key=lambda p: (not p.fits, round(p.step_s, 9), -p.layout.grad_bits, p.layout.quant_weights,
                                      p.layout.stage))


def format_plans(plans: list[Plan], top: int = 10) -> str:
    """A table of the ``top`` layouts, then the traffic of the best one collective by collective."""
    head = f"{'layout':<42} {'step ms':>9} {'exposed ms':>10} {'tokens/s':>11} {'cross-node MB':>13} " \
           f"{'GB/device':>9} fits"
    rows = [head, "-" * len(head)]
    for p in plans[:top]:
        rows.append(f"{p.layout.describe():<42} {p.step_s * 1e3:>9.1f} {p.exposed_comm_s * 1e3:>10.1f} "
                    f"{p.tokens_per_s:>11,.0f} {p.inter_bytes / 1e6:>13,.0f} {p.device_bytes / 1e9:>9.1f} "
                    f"{'yes' if p.fits else 'no'}")
    best = plans[0]
    rows.append(f"\nFastest that fits: {best.layout.describe()} (compute {best.compute_s * 1e3:.1f} ms, "
                f"exposed communication {best.exposed_comm_s * 1e3:.1f} ms)")
    for x in best.collectives:
        where = "across nodes" if x.crosses_nodes else "inside a node"
        rows.append(f"  {x.name:<38} {x.nbytes / 1e6:>10,.1f} MB over {x.group:>4} ranks {where:<14} "
                    f"{x.seconds * 1e3:>8.2f} ms ({x.phase})")
    return "\n".join(rows)
