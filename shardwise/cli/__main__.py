"""``python -m shardwise.cli``: the `shardwise` command (torchrun starts the ranks of ``launch -- train`` so)."""

from __future__ import annotations

import sys

from shardwise.cli.command import main

sys.exit(main())
