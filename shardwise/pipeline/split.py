"""One micro-batch's backward in two passes: B (the stage inputs' gradient) now, W (the weights') later.

The zero-bubble schedule (``zb_h1``, ``pipeline/schedule.py``) sends a stage's input gradient upstream
as soon as it is known and runs the weight gradients later, in the bubble. Autograd has no such split,
so it is made on the micro-batch's graph, as ``torch.distributed.pipelining``'s ``stage_backward_input``
/ ``stage_backward_weight`` make it (written here: ours keeps the parameters' own accumulation, so the
engine's gradient hooks, ZeRO's reductions and the tied-weight hooks fire in W as in one backward):

- The graph is walked from the outputs' nodes. ``I``: the nodes from which a stage input's gradient
  accumulator is reached (the B pass runs exactly these). An *intermediate* is a node of ``I`` with a
  child outside ``I`` that leads to a parameter: B runs it for the input's sake only (autograd computes
  only the outputs a pass needs), so its incoming gradients are captured by a pre-hook during B. An
  output whose node is outside ``I`` (a stage with no input gradient: the first) is an intermediate
  too, with the gradient it was given.
- Parameters reached through the same intermediates form one group; W runs one autograd pass per group
  from the group's intermediates (their captured gradients) to its parameters, with
  ``torch.autograd.backward(inputs=params)``: the parameters' ``AccumulateGrad`` runs as in one
  backward, with every hook. A group whose intermediates lie one behind another (a weight used twice)
  would count the nearer one's gradient twice (once given, once recomputed through the farther one), so
  each intermediate's gradient is pinned to the captured one by a pre-hook in W.

Every node computes the same gradients from the same incoming gradients with the same kernels as in one
backward, so each parameter's gradient of a micro-batch is one backward's, bit for bit; the schedule
runs the W passes in micro-batch order, so the accumulated sums are 1F1B's. The graph (every saved
activation of the micro-batch) is kept from B until its W, then let go.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _walk(roots: list[Node]) -> tuple[list[Node], dict[Node, list[Node]], dict[Node, list[Node]]]:
    """Every node reached from ``roots``, children before parents; the children and parents of each."""
    children: dict[Node, list[Node]] = {}
    parents: dict[Node, list[Node]] = {}
    order: list[Node] = []
    stack = [(n, False) for n in dict.fromkeys(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in children:
            continue
        kids = [f for f, _ in node.next_functions if f is not None]
        children[node] = kids
        stack.append((node, True))
        for k in kids:
            parents.setdefault(k, []).append(node)
            if k not in children:
                stack.append((k, False))
    return order, children, parents


class SplitBackward:
    """The B and W passes of one micro-batch: ``roots`` (outputs or the scaled loss) with their
    ``grads`` (None: ones), the stage's ``inputs`` and trainable ``params``."""

    def __init__(self, roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                 inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]):
        self.roots, self.grads = list(roots), [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads,
                                                                                                        strict=True)]
        self.inputs = [t for t in inputs if t.requires_grad]
        edges = [get_gradient_edge(r) for r in self.roots]
        order, children, parents = _walk([e.node for e in edges])
        in_targets = {get_gradient_edge(t).node for t in self.inputs}
        by_node = {get_gradient_edge(p).node: p for p in params if p.requires_grad}
        reach_in: dict[Node, bool] = {}
        reach_w: dict[Node, bool] = {}
        for n in order:  # children first
            reach_in[n] = n in in_targets or any(reach_in[c] for c in children[n])
            reach_w[n] = n in by_node or any(reach_w[c] for c in children[n])
        self.inner = [n for n in order if reach_in[n] and any(reach_w[c] and not reach_in[c] for c in children[n])]
        # outputs outside I: their given gradient is the W pass's starting point (no capture needed); one
        # node may make several outputs (a split), each its own edge
        self.given: dict[Node, list[tuple[GradientEdge, torch.Tensor]]] = {}
        for e, g in zip(edges, self.grads, strict=True):
            if not reach_in[e.node] and reach_w[e.node]:
                self.given.setdefault(e.node, []).append((e, g))
        self.groups = self._group(by_node, parents, reach_in)
        self.captured: dict[Node, tuple] = {}

    def _group(self, by_node: dict[Node, torch.Tensor], parents: dict[Node, list[Node]],
               reach_in: dict[Node, bool]) -> list[tuple[list[Node], list[torch.Tensor]]]:
        """The parameters reached through shared starting points, with those points (intermediates and
        outputs outside ``I``), in a fixed order."""
        owner: dict[Node, int] = {}  # starting point -> group index (merged as they are found)
        groups: list[tuple[set, list]] = []
        for acc, p in by_node.items():
            if acc not in reach_in:
                continue  # not reached from this micro-batch's outputs: no gradient
            hits, seen, todo = set(), {acc}, [acc]
            while todo:
                node = todo.pop()
                if node in self.given:
                    hits.add(node)
                for up in parents.get(node, []):
                    if up in seen:
                        continue
                    seen.add(up)
                    (hits.add(up) if reach_in[up] else todo.append(up))
            joined = sorted({owner[h] for h in hits if h in owner})
            points, members = set(hits), [p]
            for j in joined:
                points |= groups[j][0]
                members += groups[j][1]
                groups[j] = (set(), [])
            groups.append((points, members))
            for h in points:
                owner[h] = len(groups) - 1
        rank = {n: i for i, n in enumerate(self.inner + list(self.given))}
        return [(sorted(pts, key=rank.__getitem__), ps) for pts, ps in groups if ps]

    def input_pass(self) -> list[torch.Tensor | None]:
        """B: the inputs' gradients (None where an input got none), capturing each intermediate's incoming
        gradients. The graph is kept for W (through the intermediates); the outputs themselves are let go."""
        try:
            return self._input_grads()
        finally:
            self.roots, self.grads, self.inputs = [], [], []

    def _input_grads(self) -> list[torch.Tensor | None]:
        if not self.inputs:
            return []

        def capture(node: Node):
            def hook(grad_outputs: tuple) -> None:
                self.captured[node] = tuple(grad_outputs)
            return hook

        handles = [n.register_prehook(capture(n)) for n in self.inner]
        try:
            return list(torch.autograd.grad(self.roots, self.inputs, self.grads, retain_graph=True,
                                            allow_unused=True))
        finally:
            for h in handles:
                h.remove()

    def weight_pass(self) -> None:
        """W: each group's parameters' gradients accumulated (one autograd pass a group), then the graph
        let go."""
        for points, params in self.groups:
            edges: list[GradientEdge] = []
            grads: list[torch.Tensor] = []
            for n in points:
                if n in self.given:
                    edges += [e for e, _ in self.given[n]]
                    grads += [g for _, g in self.given[n]]
                    continue
                for k, g in enumerate(self.captured.get(n, ())):
                    if g is not None:
                        edges.append(GradientEdge(n, k))
                        grads.append(g)
            if not edges:
                continue  # no gradient reached these parameters (as one backward: nothing accumulated)
            pinned = [n for n in points if n in self.captured]
            handles = ([n.register_prehook(lambda _g, saved=self.captured[n]: saved) for n in pinned]
                       if len(points) > 1 else [])
            try:
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=params)
            finally:
                for h in handles:
                    h.remove()
        self.roots = self.grads = self.inputs = self.groups = []  # the graph goes with the last reference
        self.inner, self.given, self.captured = [], {}, {}
