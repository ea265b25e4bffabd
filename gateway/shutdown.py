"""Stopping like a service: SIGTERM (systemd, Docker, Kubernetes) and SIGINT (Ctrl-C), at any
moment after start, unwind to the stack's own stop instead of killing the process.

The handler raises `ShutdownRequested` in the main thread, which interrupts whatever start-up
or serving step is running there; the caller's `finally` calls `ignore()` and then stops what
was started, so a second signal cannot cut that (bounded) stop short. `ShutdownRequested` is
a KeyboardInterrupt because Ray runs pending signal handlers inside its own blocking calls
(`ray._raylet.check_signals`) and passes on only KeyboardInterrupt and SystemExit, printing
and dropping anything else. `ray.init` installs a SIGTERM handler of its own (`sys.exit(15)`
from wherever the driver is, which has aborted the process inside Ray's C++ core);
`keep_handlers` puts ours back around such calls.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_requested = threading.Event()  # a signal arrived: whatever handlers are restored, the stop is on


class ShutdownRequested(KeyboardInterrupt):  # noqa: N818 (a request, not an error)
    """SIGTERM or SIGINT arrived: unwind and stop the stack."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_shutdown(signum: int, _frame) -> None:
    if _requested.is_set():  # the first signal is unwinding to the stop: do not interrupt that
        _ignore_during_stop(signum, _frame)
        return
    _requested.set()
    raise ShutdownRequested(signum)


def _ignore_during_stop(signum: int, _frame) -> None:
    # os.write, not print: the main thread may be inside a write to stderr right now
    os.write(2, f"[prefixgate] {signal.Signals(signum).name} ignored: already shutting down\n".encode())


def install() -> None:
    """From now on SIGTERM and SIGINT raise ShutdownRequested in the main thread."""
    _requested.clear()
    for s in SIGNALS:
        signal.signal(s, _raise_shutdown)


def ignore() -> None:
    """From now on SIGTERM and SIGINT only say that the stop is already under way."""
    for s in SIGNALS:
        signal.signal(s, _ignore_during_stop)


@contextmanager
def keep_handlers() -> Iterator[None]:
    """Around ray.init: a signal is only recorded while it runs, and ShutdownRequested is
    raised once it has returned. An exception raised into ray.init's node start-up (ours, or
    Ray's own `sys.exit(15)` handler, which ray.init installs) aborted the process with
    "terminate called without an active exception" (SIGABRT), so Ray's handler is not
    installed and ours only take note until the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import ray._private.utils as ray_utils

    saved = {s: signal.getsignal(s) for s in SIGNALS}
    deferred: list[int] = []
    set_sigterm_handler = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda _handler: None  # keep ours (ray.init looks it up per call)
    for s in SIGNALS:
        signal.signal(s, lambda signum, _frame: deferred.append(signum))
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = set_sigterm_handler
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(s, handler)
    if not deferred:
        return
    handler = saved[deferred[0]]
    if handler is _raise_shutdown:
        if not _requested.is_set():
            _requested.set()
            raise ShutdownRequested(deferred[0])
    elif callable(handler):  # someone else's (e.g. pytest's SIGINT): deliver it now
        handler(deferred[0], None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), deferred[0])  # the default action, now that ray.init is done


def become_subreaper() -> None:
    """Linux: processes orphaned below us (a Ray agent whose raylet died first) become our
    children instead of init's, so the stop finds and ends them (LocalStack.stop)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_child_subreaper = 36
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


SUPERVISED_ENV = "PREFIXGATE_STACK_PROCESS"  # set in the child that runs the stack


def supervise(argv: list[str]) -> int:
    """Run `prefixgate` with `argv` in a child process in a process group of its own, forward
    SIGTERM/SIGINT to it, and exit with its status.

    A terminal's Ctrl-C, `kill -TERM -- -PGID` and init systems that signal a whole process group
    reach every process in it. Ray's processes (its node, Serve's controller, proxies and
    replicas) started by the stack inherit the stack's group: signalled directly they die at once,
    in-flight requests get no drain, and the stop waits out Serve's 30 s controller timeout. Here
    only this thin process is in the caller's group; the stack's process receives one signal,
    from us, and stops in order.
    """
    import subprocess

    env = {**os.environ, SUPERVISED_ENV: "1"}
    child = subprocess.Popen([sys.executable, "-m", "gateway.cli", *argv], env=env, process_group=0)

    def forward(signum: int, _frame) -> None:
        try:
            child.send_signal(signum)  # the stack's own handler ignores repeats while it stops
        except ProcessLookupError:
            pass

    for s in SIGNALS:
        signal.signal(s, forward)
    code = child.wait()
    return 128 - code if code < 0 else code  # killed by a signal: the shell's convention


def supervised() -> bool:
    """Whether this process is the stack's own (started by `supervise`)."""
    return os.environ.get(SUPERVISED_ENV) == "1"
