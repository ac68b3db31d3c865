"""The PYTHONPATH hook: a folder that makes a fresh interpreter's ``import deepspeed`` install the
facade, for processes shardwise does not start itself (``torchrun``, a job scheduler, subprocesses).

It holds a ``deepspeed`` package whose ``__init__`` calls :func:`install_as_deepspeed`, and a
``deepspeed.dist-info`` with the facade's version, because transformers and accelerate ask
``importlib.metadata`` whether DeepSpeed is installed before they import it.
"""

from __future__ import annotations

from pathlib import Path

from shardwise.deepspeed.surface import VERSION

HOOK_MARKER = "SHARDWISE_DEEPSPEED_HOOK"

_INIT = '''"""Written by shardwise (python -m shardwise.deepspeed hook): `import deepspeed` is shardwise's facade."""
__shardwise_hook__ = True
from shardwise.deepspeed import install_as_deepspeed

install_as_deepspeed()  # replaces this module by the facade in sys.modules
'''


def write_hook(folder: str | Path) -> Path:
    """Write the hook into ``folder`` (created if needed) and return it; put it first on PYTHONPATH."""
    root = Path(folder).resolve()
    (root / "deepspeed").mkdir(parents=True, exist_ok=True)
    (root / "deepspeed" / "__init__.py").write_text(_INIT)
    info = root / "deepspeed.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {VERSION}\n"
                                   "Summary: shardwise's DeepSpeed facade\n")
    (root / HOOK_MARKER).write_text("a folder written by shardwise; safe to delete\n")
    return root
