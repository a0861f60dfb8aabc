"""Ctrl-C during training: stop at the end of the step with a checkpoint."""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager

logger = logging.getLogger(__name__)


@contextmanager
def interrupt_requested():
    """An event that Ctrl-C (SIGINT) sets instead of raising, so that a training run stops at the end of its
    step with a checkpoint, as at its time budget; a second Ctrl-C raises KeyboardInterrupt as usual. Signal
    handlers belong to the main thread: elsewhere the event is never set. A process that ignores SIGINT (started
    with `nohup ... &`) keeps ignoring it."""
    requested = threading.Event()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield requested
        return

    def handler(signum, frame):
        requested.set()
        signal.signal(signal.SIGINT, previous)
        logger.info(
            "stopping after this step with a checkpoint (Ctrl-C again stops at once, losing the steps "
            "since the last checkpoint)"
        )

    signal.signal(signal.SIGINT, handler)
    try:
        yield requested
    finally:
        signal.signal(signal.SIGINT, previous)
