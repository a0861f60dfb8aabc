"""The processes of one job (MLX distributed, started by `mlx.launch`): joining them, and what keeps a lost one
from hanging the others. Used by data-parallel training (`train/`) and by a sharded target (`distributed.py`).

A rank that dies ends the others with a clear error: on the ring backend its process's end closes its sockets,
and the next collective raises "connection to a peer was lost", which `ProcessGroup` turns into `PeerLost`. A rank that
stops answering without closing them (a hung process, a machine gone, a cable pulled) would leave the others
waiting forever; a watchdog thread ends this process when a collective has waited `timeout` seconds for the
others. The collective's `mx.eval` lets that thread run; `mx.distributed.init` and a first exchange do not (they
hold the interpreter), so those are bounded by a watchdog process instead (`deadline`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

logger = logging.getLogger(__name__)

LAUNCHED = "MLX_RANK"  # set by `mlx.launch` (and by hand: MLX_RANK with MLX_HOSTFILE) in every process it starts
DEFAULT_TIMEOUT = 300.0  # seconds a collective waits for the other ranks before this process gives up
WATCHDOG_EXIT = 3  # the exit status of a process the watchdog ended


class PeerLost(RuntimeError):
    """Another rank of the run died or stopped answering."""


def launched() -> bool:
    """Whether this process was started as one rank of several (`mlx.launch`)."""
    return LAUNCHED in os.environ


def world_size() -> int | None:
    """The number of ranks `mlx.launch` started, read from its environment before joining them (the ring
    backend's MLX_HOSTFILE lists one entry a rank); None where it does not say."""
    path = os.environ.get("MLX_HOSTFILE")
    try:
        return len(json.loads(Path(path).read_text())) if path else None
    except (OSError, ValueError, TypeError):
        return None


@contextmanager
def deadline(seconds: float, message: str):
    """End this process with `message` on stderr if the block still runs after `seconds`. The calls it guards
    (connecting, the first exchanges) block inside MLX, where no Python thread or signal handler runs, so a
    watchdog process ends it (SIGKILL)."""
    me = os.getpid()
    code = (
        f"import os, signal, sys, time\ntime.sleep({float(seconds)!r})\nif os.getppid() == {me}:\n"
        f"    sys.stderr.write({message!r} + '\\n')\n    sys.stderr.flush()\n    os.kill({me}, signal.SIGKILL)\n"
    )
    watchdog = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
    try:
        yield
    finally:
        watchdog.kill()
        watchdog.wait()


class Watchdog:
    """A thread that ends this process (exit WATCHDOG_EXIT) once the deadline it holds passes: for waits on the other
    processes inside MLX collectives that may never return (the ring backend's all_gather when a peer dies);
    `mx.eval` lets the thread run. `arm(message)` sets the deadline `timeout` seconds from now, `disarm` clears
    it; `say` writes the message before the process ends."""

    def __init__(self, timeout: float, name: str, say):
        self.timeout, self._say = timeout, say
        self._lock = threading.Lock()
        self._armed: tuple[float, str] | None = None  # (deadline, message)
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name=name, daemon=True).start()

    def arm(self, message: str) -> None:
        with self._lock:
            self._armed = (time.monotonic() + self.timeout, message)

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.timeout / 10)):
            with self._lock:
                armed = self._armed
            if armed is not None and time.monotonic() > armed[0]:
                self._say(armed[1])
                sys.stderr.flush()
                os._exit(WATCHDOG_EXIT)


@contextmanager
def progress_watch(timeout: float, message: str):
    """Inside the block the callable it yields (`tick`) must be called at least every `timeout` seconds; a block
    stuck longer ends this process with `message` on stderr (a `Watchdog`)."""
    watchdog = Watchdog(timeout, "dflash2-progress-watchdog", lambda text: sys.stderr.write(text + "\n"))
    watchdog.arm(message)
    try:
        yield lambda: watchdog.arm(message)
    finally:
        watchdog.close()


def join(timeout: float = DEFAULT_TIMEOUT, backend: str = "any", command: str = "train") -> ProcessGroup:
    """`connect`, and the collectives of a data-parallel run under the watchdog thread."""
    return ProcessGroup(connect(timeout, backend, command), timeout)


def connect(timeout: float = DEFAULT_TIMEOUT, backend: str = "any", command: str = "train") -> mx.distributed.Group:
    """The group of this job's processes (`mx.distributed.init(strict=True)`), or an error naming the problem and
    the `dflash2 command` to launch. A process that cannot reach the others within `timeout` seconds ends with a
    message naming the hostfile."""
    if not mx.distributed.is_available():
        raise ValueError(
            "this MLX build has no distributed backend; install mlx with one (the ring backend is in "
            f"every macOS and Linux build) or run `dflash2 {command}` without mlx.launch"
        )
    hostfile = os.environ.get("MLX_HOSTFILE", "none given")
    logger.info("joining the other ranks: if one does not answer within %.0f s, this process ends", timeout)
    message = (
        f"dflash2: error: rank {os.environ.get('MLX_RANK', '?')} got no answer from the other processes "
        f"within {timeout:g} s (hostfile: {hostfile}); check that every host in it is up and reachable, "
        "and that each was started with the same command (mlx.launch starts them all)"
    )
    with deadline(timeout, message):
        try:
            group = mx.distributed.init(strict=True, backend=backend)
        except RuntimeError as e:
            raise ValueError(
                f"could not connect the processes (MLX distributed, {backend} backend; hostfile: {hostfile}): {e}. "
                f"Start every process with mlx.launch: `mlx.launch -n 2 python -m dflash2_apps.cli {command} ...` "
                f"on one Mac, `mlx.launch --hostfile hosts.json -- python -m dflash2_apps.cli {command} ...` across "
                "Macs"
            ) from e
    return group


class ProcessGroup:
    """The ranks of one run: their collectives, each evaluated at once under the watchdog, and rank 0 (`main`),
    the one that writes. `note`: what the error of a lost rank adds (where the run can be continued from)."""

    def __init__(self, group, timeout: float = DEFAULT_TIMEOUT):
        self.group, self.timeout = group, timeout
        self.rank, self.size = group.rank(), group.size()
        self.main = self.rank == 0
        self.note = ""
        self._watchdog = Watchdog(timeout, "dflash2-peer-watchdog", self._give_up)

    def __repr__(self) -> str:
        return f"ProcessGroup(rank {self.rank} of {self.size})"

    # -- the watchdog -----------------------------------------------------------------------------------------
    def _give_up(self, text: str) -> None:
        logger.critical("rank %d of %d: %s", self.rank, self.size, text)
        for handler in logging.getLogger().handlers + logger.handlers:
            handler.flush()

    def _lost_text(self, what: str, why: str) -> str:
        return f"{why} during {what}: a rank died or hangs, and this one stops" + (
            f"; {self.note}" if self.note else ""
        )

    @contextmanager
    def waiting(self, what: str):
        """Evaluations inside the block wait on the other ranks: the watchdog ends this process if the block
        lasts `timeout` seconds, and a lost connection becomes `PeerLost`."""
        self._watchdog.arm(self._lost_text(what, f"no answer from the other ranks for {self.timeout:.0f} s"))
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, PeerLost):
                raise
            raise PeerLost(
                f"rank {self.rank} of {self.size}: " + self._lost_text(what, f"lost the other ranks ({e})")
            ) from e
        finally:
            self._watchdog.disarm()

    # -- collectives --------------------------------------------------------------------------------------
    def sum(self, x, what: str):
        """all_sum of an array or a tree of arrays (one message per dtype), evaluated."""
        flat = tree_flatten(x) if not isinstance(x, mx.array) else [("", x)]
        out = dict()
        for dtype in dict.fromkeys(v.dtype for _, v in flat):  # in order of appearance: the same on every rank
            names = [k for k, v in flat if v.dtype == dtype]
            parts = [v for _, v in flat if v.dtype == dtype]
            whole = mx.concatenate([p.reshape(-1) for p in parts])
            whole = mx.distributed.all_sum(whole, group=self.group)
            with self.waiting(what):
                mx.eval(whole)
            offsets = np.cumsum([0] + [p.size for p in parts])
            for k, p, a, b in zip(names, parts, offsets[:-1], offsets[1:]):
                out[k] = whole[int(a) : int(b)].reshape(p.shape)
        if isinstance(x, mx.array):
            return out[""]
        leaves = iter(out[k] for k, _ in flat)
        return tree_map(lambda _: next(leaves), x)  # the same structure (tree_map walks it as tree_flatten does)

    def any(self, flag: bool, what: str) -> bool:
        """Whether any rank's `flag` is set."""
        return bool(self.sum(mx.array([int(flag)], mx.int32), what).item())

    def barrier(self, what: str) -> None:
        self.sum(mx.zeros((1,), mx.int32), what)

    def from_main(self, x, what: str):
        """Rank 0's array or tree (the others' are replaced): a sum to which the others add zeros, exact."""
        return self.sum(x if self.main else tree_map(mx.zeros_like, x), what)

    def same(self, values, what: str) -> bool:
        """Whether every rank holds the same small non-negative ints `values` (e.g. the bytes of a fingerprint of
        its settings and data); every rank gets the same answer."""
        values = mx.array(np.asarray(values, np.int32))
        differs = bool(mx.any(self.sum(values, what) != self.size * values).item())
        return not self.any(differs, what)
