"""``python -m shardwise.deepspeed names | hook DIR``: the served-name list, or the PYTHONPATH hook."""

from __future__ import annotations

import argparse
import sys

from shardwise.deepspeed.hook import write_hook
from shardwise.deepspeed.surface import name_table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardwise.deepspeed", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("names", help="print the markdown table of every DeepSpeed name the facade serves")
    hook = sub.add_parser("hook", help="write the PYTHONPATH hook folder and print its path")
    hook.add_argument("dir", help="folder to write (created if needed)")
    a = p.parse_args(argv)
    if a.cmd == "names":
        sys.stdout.write(name_table())
    else:
        print(write_hook(a.dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
