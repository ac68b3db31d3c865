"""``python -m shardwise.deepspeed names | hook DIR``: the served-name list, or the PYTHONPATH hook."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from shardwise.deepspeed.hook import write_hook
from shardwise.deepspeed.surface import name_table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardwise.deepspeed", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    names = sub.add_parser("names", help="print the markdown table of every DeepSpeed name the facade serves")
    names.add_argument("--update", metavar="DOC", help="instead, rewrite the table between the "
                                                       "<!-- names:begin --> / <!-- names:end --> markers of DOC")
    hook = sub.add_parser("hook", help="write the PYTHONPATH hook folder and print its path")
    hook.add_argument("dir", help="folder to write (created if needed)")
    a = p.parse_args(argv)
    if a.cmd == "names" and a.update:
        doc = Path(a.update)
        text, n = re.subn(r"(<!-- names:begin -->\n).*?(<!-- names:end -->)",
                          lambda m: m.group(1) + name_table() + m.group(2), doc.read_text(), flags=re.S)
        if n != 1:
            p.error(f"{doc}: no <!-- names:begin --> ... <!-- names:end --> block")
        doc.write_text(text)
    elif a.cmd == "names":
        sys.stdout.write(name_table())
    else:
        print(write_hook(a.dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
