"""``shardwise quantize``: an int8/int4 copy of an HF model folder for streamed generate."""

from __future__ import annotations

import sys

from shardwise.cli.parsers import quantize_parser
from shardwise.errors import one_line
from shardwise.inference.quantize import quantize_folder
from shardwise.inference.quantized_linear import write_block_rows


def main(argv: list[str] | None = None) -> int:
    """Quantize ``argv``'s folder; 2 and one line on stderr for what cannot be written."""
    p = quantize_parser(write_block_rows())
    args = p.parse_args(argv)
    try:
        rep = quantize_folder(args.src, args.dst, args.bits, args.group_size, overwrite=args.overwrite,
                              block_rows=args.kernel_order)
    except (ValueError, OSError) as e:
        print(f"shardwise quantize: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"{args.dst}: {rep['tensors_quantized']} weights to {args.bits} bits (groups of {args.group_size}); "
          f"{rep['bytes_before'] / 2**20:.1f} MiB -> {rep['bytes_after'] / 2**20:.1f} MiB")
    return 0
