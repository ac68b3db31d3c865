#!/usr/bin/env python
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
