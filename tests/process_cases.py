"""Entries for ranks forked by tests/fresh_ranks.py whose subject is what a new process starts with
(no process group yet, the environment's defaults), not its imports: each runs in a process of its own."""

from __future__ import annotations


def zero_init_joins_the_job(argv: list[str]) -> None:
    """zero.Init() in a process with the launcher's environment and no group: it joins the job."""
    import torch.distributed as dist

    import shardwise

    assert not dist.is_initialized()
    with shardwise.zero.Init():
        print(dist.is_initialized(), dist.get_world_size())


def timeout_key_applied(argv: list[str]) -> None:
    """shardwise.initialize in a process with no group: prints the collective timeout it joined with."""
    import torch
    import torch.distributed as dist

    import shardwise
    from shardwise.comm.core import _GLOBAL_TIMEOUT

    cfg = {"shardwise": {"timeout_s": 42}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    shardwise.initialize(model=torch.nn.Linear(2, 2), config=cfg)
    print(_GLOBAL_TIMEOUT[0])
    dist.destroy_process_group()


def tokenize_peak_growth(argv: list[str]) -> None:
    """Tokenize SOURCE into CACHE (argv) with the byte tokenizer; print the peak RSS growth in MiB.

    The peak is reset to the current RSS first (``/proc/self/clear_refs``), so what a forked process
    shares with its server is the baseline, as the imports are a new interpreter's."""
    from pathlib import Path

    from shardwise.train.data import list_sources, tokenize_to_cache
    from shardwise.train.model import ByteTokenizer

    def field_kib(name: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(name + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = field_kib("VmHWM")
    tokenize_to_cache(list_sources(argv[0]), ByteTokenizer(), Path(argv[1]))
    print((field_kib("VmHWM") - before) / 1024)
