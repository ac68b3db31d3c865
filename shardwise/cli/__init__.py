"""``shardwise.cli``: the `shardwise` command, the top floor of the house; the library never imports it.

Every subcommand's argument parsing lives here and calls the library: ``command`` (``main``: the
dispatch, ``shardwise launch``), ``parsers`` (the torch-free parsers of ``consolidate``, ``quantize``
and ``generate``), ``train_options`` (``shardwise train``'s flags and run config file), ``env``
(``shardwise env``), ``generate`` (``shardwise generate``), ``planner`` (the step-time planner's flags
on ``shardwise estimate``), ``train_job`` (the benchmarks' byte-level model and dataset).

Why torch-free at import: ``shardwise SUBCOMMAND --help``, ``shardwise --version``, ``shardwise env``
and ``shardwise launch`` must answer at once, and torch plus transformers take seconds to import
(8-12 s on a busy machine). The subcommands that need torch import it when they run.
"""

from __future__ import annotations

from shardwise.cli.command import main

__all__ = ["main"]
