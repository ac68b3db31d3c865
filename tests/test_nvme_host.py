"""NVMe offload's host side in one process: sub-groups stepped piece by piece equal one whole step, the
gradients read where the reduction left them (none kept on the host), and write-behind (the last writes in
flight into the next step) never lets a read see a file before its write."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardwise.nvme import NvmeSettings, OptimizerSwapper


def _group(numel: int, seed: int) -> SimpleNamespace:
    """A stage-2 group as the swapper reads it: master, reduced gradient, and where the stepped master goes."""
    g = SimpleNamespace(master=torch.randn(numel, generator=torch.Generator().manual_seed(seed)), own_numel=numel,
                        device=torch.device("cpu"), replicate=None, policy=SimpleNamespace(shard_params=False),
                        release_grad_shard=lambda: None, wait=lambda: None, wait_gathered=lambda: None,
                        published=torch.full((numel,), float("nan")))
    g.grad = torch.randn(numel, generator=torch.Generator().manual_seed(seed + 100))
    g.owned_grad = lambda: g.grad

    def publish_master(async_op: bool, copied: bool = False) -> None:
        if not copied:
            g.published.copy_(g.master)

    g.publish_master = publish_master
    g.publish_piece = lambda src, start: g.published[start:start + src.numel()].copy_(src)
    return g


@pytest.mark.parametrize(("sub_group_size", "buffers"), [(1_000_000_000, 3), (3000, 2), (2500, 4)])
def test_pieces_and_write_behind_equal_whole_steps(tmp_path: Path, sub_group_size: int, buffers: int) -> None:
    """Three groups (one smaller than a piece), three steps with gradients that change: the published
    masters and the states read back equal AdamW on the whole tensors, to the bit."""
    groups = [_group(n, i) for i, n in enumerate((7000, 1000, 5003))]
    ref = [g.master.clone().requires_grad_() for g in groups]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW([g.master for g in groups], lr=1e-2, weight_decay=0.1)
    settings = NvmeSettings(nvme_path=tmp_path, buffer_count=buffers, pipeline_read=True, pipeline_write=True,
                            sub_group_size=sub_group_size)
    swapper = OptimizerSwapper(groups, opt, settings, rank=0)
    sharding = SimpleNamespace(groups=groups, wait_for_params=lambda: None,
                               grad_norm=lambda squares, squared: float(sum(squares)) ** 0.5)
    try:
        for step in range(3):
            for g, r in zip(groups, ref, strict=True):
                g.grad.mul_(-1.5)  # a new gradient each step
                r.grad = g.grad * 0.5  # the unscale below
            norm = swapper.grad_norm(sharding, 0.5)
            assert norm == pytest.approx(float(sum(r.grad.double().square().sum() for r in ref)) ** 0.5)
            ref_opt.step()
            swapper.step_and_publish(sharding)
            assert all(torch.equal(g.published, r.detach()) for g, r in zip(groups, ref, strict=True)), step
            assert all(g.master.grad is None and g.master.stride() == (0,) for g in groups)  # nothing resident
        pieces = len(swapper.pieces)
        assert pieces == (3 if sub_group_size > 7000 else sum(-(-n // sub_group_size) for n in (7000, 1000, 5003)))
        assert swapper.writing or not settings.pipeline_write  # the last writes went on after the step
        with swapper.resident(write_back=False):  # waits for them: the files read back are the step's
            for g, r in zip(groups, ref, strict=True):
                assert torch.equal(g.master, r.detach())
                assert torch.equal(opt.state[g.master]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])
                assert opt.state[g.master]["step"] == 3
    finally:
        swapper.close()


def test_a_read_waits_for_the_write_behind_of_its_piece(tmp_path: Path) -> None:
    """The first piece's write is still in flight (slow) when the next step's read-ahead of that piece is
    issued: the read waits for it (a read before would find the older generation, or torn bytes). The
    buffers' first-in first-out reuse orders it here; ``_submit_read`` also waits for the piece's own write."""
    import time

    groups = [_group(4096, i) for i in range(3)]
    opt = torch.optim.Adam([g.master for g in groups])
    swapper = OptimizerSwapper(groups, opt, NvmeSettings(nvme_path=tmp_path, buffer_count=3, pipeline_read=True,
                                                         pipeline_write=True), rank=0)
    write = swapper.io.write

    def slow_first(f, t, offset=0):
        if f is swapper.files[0]:
            time.sleep(0.3)
        return write(f, t, offset)

    swapper.io.write = slow_first
    sharding = SimpleNamespace(groups=groups, wait_for_params=lambda: None,
                               grad_norm=lambda squares, squared: float(sum(squares)) ** 0.5)
    try:
        for _ in range(2):
            swapper.grad_norm(sharding, 1.0)
            swapper.step_and_publish(sharding)
        with swapper.resident(write_back=False):
            assert opt.state[groups[0].master]["step"] == 2
    finally:
        swapper.close()
