"""Review of the NVMe tier's failure paths: a swap file that fails its check is never rewritten as current,
and the parameters' room check counts the bytes their files hold."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardwise.nvme import NvmeSettings, OptimizerSwapper, SwapFileError


def _group(numel: int) -> SimpleNamespace:
    return SimpleNamespace(master=torch.arange(numel, dtype=torch.float32), own_numel=numel)


def test_a_failed_read_under_resident_does_not_restamp_the_bad_file(tmp_path: Path) -> None:
    groups = [_group(8), _group(8)]
    opt = torch.optim.Adam([g.master for g in groups])
    swapper = OptimizerSwapper(groups, opt, NvmeSettings(nvme_path=tmp_path), rank=0)
    try:
        path = swapper.layouts[1].path
        raw = bytearray(path.read_bytes())
        raw[4096] ^= 0xFF  # a byte of group 1's master changed on disk
        path.write_bytes(bytes(raw))
        with pytest.raises(SwapFileError, match="group00001.swap"), swapper.resident(write_back=True):
            pass
        # the bad file is still refused: not rewritten from the stand-in (NaN) with a fresh stamp
        with pytest.raises(SwapFileError, match="group00001.swap"), swapper.resident(write_back=False):
            pass
    finally:
        swapper.close()
