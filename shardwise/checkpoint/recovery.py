"""``zero_to_fp32.py`` in every checkpoint folder, where DeepSpeed puts its own (next to ``latest``).

Users are told to ``cd checkpoint-N; python zero_to_fp32.py . OUT --safe_serialization`` to get
full weights out of a ZeRO checkpoint; the HF Trainer's checkpoint folders get this script from
DeepSpeed. shardwise writes a short one that runs shardwise's converter
(:func:`shardwise.utils.zero_to_fp32.main`, DeepSpeed's flags), whether or not DeepSpeed is
installed: DeepSpeed's own script cannot read shardwise's format.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shardwise.files.safe import write_atomic

SCRIPT_NAME = "zero_to_fp32.py"
SCRIPT = '''#!/usr/bin/env python
"""Full fp32 weights from the shardwise checkpoint in this folder, as DeepSpeed's zero_to_fp32.py.

    python zero_to_fp32.py . OUT [--safe_serialization] [-t TAG] [--max_shard_size 5GB]
                                 [--exclude_frozen_parameters]

Written by shardwise when it saved the checkpoint; runs shardwise's converter (DeepSpeed need not
be installed, and DeepSpeed's own script cannot read this format).
"""
import sys

try:
    from shardwise.utils.zero_to_fp32 import main
except ImportError:
    print("zero_to_fp32.py: this checkpoint was saved by shardwise; install shardwise to convert it",
          file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
'''


def write_recovery_script(root: Path) -> None:
    """Rank 0, after a save: ``root/zero_to_fp32.py``, executable (as DeepSpeed makes its copy)."""
    path = root / SCRIPT_NAME
    if path.is_symlink():  # never write through a link planted in the checkpoint folder
        path.unlink()
    write_atomic(path, SCRIPT.encode())
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
