"""An exclusive lock for one build directory that can never go stale.

It is an flock(2) on a file in the directory, so the kernel drops it the moment its holder dies, whatever kills it
(Ctrl-C, SIGTERM, SIGKILL): a waiter whose builder is gone takes the lock over at once. The holder writes its pid,
host and start time into the file, so that a waiter can say every few seconds whom it waits for, and for how long.
The descriptor is not inherited by the compilers the builder starts (Python opens files close-on-exec).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)


def _holder(path: Path) -> str:
    """Who holds the lock, in words, from what it wrote into the file."""
    try:
        info = json.loads(path.read_text() or "{}")
        return f"pid {info['pid']} on {info['host']}, building since {time.ctime(info['since'])}"
    except (OSError, ValueError, KeyError):
        return "a process that has not yet said who it is"


@contextmanager
def build_lock(path: Path, what: str, poll_s: float = 0.1, report_every_s: float = 5.0,
               report: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the lock at `path` for the duration of the block; `what` names the build in the waiting messages."""
    report = report or logger.warning
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        next_report = start + report_every_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now >= next_report:
                    report(f"waiting {now - start:.0f}s for {what} by {_holder(path)} (lock {path})")
                    next_report = now + report_every_s
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # released: nobody to name
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
