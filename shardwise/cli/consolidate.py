"""``shardwise consolidate``: a sharded checkpoint (a run folder, a tag) into an HF folder, offline."""

from __future__ import annotations

import sys
from pathlib import Path

from shardwise.checkpoint import CheckpointError, consolidate
from shardwise.checkpoint.run_files import side_files_in
from shardwise.cli.parsers import consolidate_parser
from shardwise.errors import one_line


def main(argv: list[str] | None = None) -> int:
    """``shardwise consolidate``: sharded checkpoint -> HF folder loadable by ``from_pretrained``."""
    p = consolidate_parser()
    a = p.parse_args(argv)
    if not Path(a.ckpt_dir).is_dir():
        p.error(f"{a.ckpt_dir!r} is not a folder; pass the folder given to save_checkpoint")
    try:
        names = consolidate(a.ckpt_dir, a.out_dir, a.tag, a.dtype, a.max_shard_size, not a.no_verify,
                            config=a.config, weights_only=a.weights_only, overwrite=a.overwrite)
    except (CheckpointError, ValueError, OSError) as e:  # UserError is a ValueError
        print(f"shardwise consolidate: error: {one_line(e)}", file=sys.stderr)
        return 2
    has_tokenizer = any(n.startswith(("tokenizer", "vocab")) for n in side_files_in(a.out_dir))
    print(f"wrote {len(names)} weight file(s) to {a.out_dir}" + (" with the tokenizer" if has_tokenizer else
          "; no tokenizer was saved with the checkpoint: copy the model's tokenizer files there for generate"))
    return 0
