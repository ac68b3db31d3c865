"""One-command check of shardwise on one NVIDIA GPU (at most ~10 minutes): writes a JSON and a markdown table.

    python benchmarks/gpu_check.py                      # on the GPU machine: every section
    python benchmarks/gpu_check.py --smoke              # anywhere, tiny sizes, CUDA-only sections skipped

The command the guide and the GPU notes name; the check itself is ``benchmarks/gpu/`` (``check.py`` runs
the sections of ``sections.py`` and reads the goals of ``goals.py``). docs/gpu_check.md says more.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: the check imports as gpu.*

from gpu.check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
