"""``shardwise launch``'s process side: torchrun's agent, with its failures reported in one line.

- ``agent``: ``python -m shardwise.launch.agent [--subcommand] TORCHRUN_ARGS``, what ``shardwise
  launch`` starts (the command line itself is built in ``shardwise/cli/command.py``).
"""

from __future__ import annotations
