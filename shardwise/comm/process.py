"""What a rank process does around its collectives but not with them: keep other ranks' progress
bars quiet, and wait at exit until gloo's worker threads are idle (``core._teardown``)."""

from __future__ import annotations

import os
import sys


def quiet_progress_bars() -> None:
    """No Hugging Face progress bars in this process (transformers' "Loading weights", the Hub's
    downloads): every rank but 0 calls it, so N ranks print one bar, not N interleaved ones.
    Libraries not imported yet read the environment variable when they are; imported ones are told."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None and hasattr(hub, "disable_progress_bars"):
        hub.disable_progress_bars()
    tf_logging = sys.modules.get("transformers.utils.logging")
    if tf_logging is not None and hasattr(tf_logging, "disable_progress_bar"):
        tf_logging.disable_progress_bar()


def let_worker_threads_settle(limit_s: float = 1.0, step_s: float = 0.005, calm_polls: int = 3) -> None:
    """Sleep (GIL released) until no other thread of this process is runnable, at most ``limit_s``.

    A gloo worker still freeing its last collective is either runnable or waiting for the GIL,
    which each sleep hands over; once it is done it blocks on its queue. ``calm_polls``
    consecutive polls with no runnable thread mean no worker is left inside that window. Reads
    thread states from ``/proc/self/task``; where that does not exist, the sleeps alone remain.
    """
    import threading
    import time

    me, calm = threading.get_native_id(), 0
    deadline = time.monotonic() + limit_s
    while calm < calm_polls and time.monotonic() < deadline:
        time.sleep(step_s)
        calm = 0 if _other_thread_runnable(me) else calm + 1


def _other_thread_runnable(me: int) -> bool:
    try:
        tids = [t for t in os.listdir("/proc/self/task") if int(t) != me]
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        if state == "R":
            return True
    return False
