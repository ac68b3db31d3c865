"""The `shardwise` command's parts that load without torch: argument parsers and the
environment report.

Why a package of its own: ``shardwise SUBCOMMAND --help``, ``shardwise --version`` and ``shardwise
env`` must answer at once, and torch plus transformers take seconds to import (8-12 s on a busy
machine). The subcommands' modules import torch at their top, so their parsers live here and
``shardwise.cli`` builds one of them to print help before importing the subcommand itself.

- ``parsers``: the parsers of ``consolidate``, ``quantize`` and ``generate`` (``train``'s is
  ``shardwise.train.options.build_parser``, also torch-free).
- ``env``: ``shardwise env``: versions, backends, devices, optional extras, what the facade serves.
"""

from __future__ import annotations
