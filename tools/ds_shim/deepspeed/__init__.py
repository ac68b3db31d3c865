"""Test-harness shim, not part of the library: ``import deepspeed`` resolved to shardwise.

Used only by ``tools/ds_conformance.py`` to run DeepSpeed's own unit tests against shardwise with
the import as the only change. Every ``deepspeed.*`` module path resolves to a proxy that serves
shardwise's object of the same public name; a name shardwise lacks becomes a stub that raises
:class:`ShimMissing` naming it when used, so each test fails (or passes) on its own and the report
can say which DeepSpeed name it needed.
"""

from deepspeed._proxy import ShimMissing, install  # noqa: F401
from shardwise import *  # noqa: F403
from shardwise import (  # noqa: F401
    __git_branch__,
    __git_hash__,
    __version__,
    __version_major__,
    __version_minor__,
    __version_patch__,
    add_config_arguments,
    comm,
    init_distributed,
    init_inference,
    initialize,
    utils,
    zero,
)

install()
