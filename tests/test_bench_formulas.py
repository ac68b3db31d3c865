"""The scaling table's "formula" column: every benchmark mode maps to the ZeRO paper's per-device bytes.

fp32 AdamW (4 + 4 + 8 bytes a parameter): 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N at stages 0-3.
Mixed precision (2-byte parameters and gradients, K = 12 bytes of fp32 masters and moments): 16Ψ,
4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N. A mode added to ``bench_report.MODES`` whose stage or precision the
formula misreads fails here, not silently in a doc table.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "zero"))

from bench_report import MODES  # noqa: E402
from bench_scaling import formula_bytes  # noqa: E402

PSI, N = 1_000_000, 4
PAPER = {"fp32": [16 * PSI, 8 * PSI + 8 * PSI / N, 4 * PSI + 12 * PSI / N, 16 * PSI / N],
         "bf16": [16 * PSI, 4 * PSI + 12 * PSI / N, 2 * PSI + 14 * PSI / N, 16 * PSI / N]}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_formula_is_the_papers_for_the_modes_stage_and_precision(mode: str) -> None:
    _framework, stage, precision = MODES[mode]
    assert formula_bytes(mode, PSI, N) == PAPER[precision][stage]
