"""Run a command in a process group of its own: output capped, time bounded, the group killed after."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time

# What is read of the child's stdout and stderr, each (``run_child``): sglang's warnings and one
# result line are a few KiB. Read in CHUNKs, polled every POLL_S; once the child exited, what
# it left running is killed and the pipes drained for at most DRAIN_S.
MAX_CHILD_OUTPUT = 8 << 20
CHUNK = 64 << 10
POLL_S = 0.2
DRAIN_S = 2.0


class OutputCapExceeded(Exception):
    """The child printed more than MAX_CHILD_OUTPUT on one stream (the stream's name)."""


def _exited(pid: int) -> bool:
    """Has the child exited? It is not reaped: its process group stays ours to kill."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def run_child(command: list, env: dict, timeout: float) -> tuple:
    """(exit code, stdout, stderr) of ``command``, run in a session (process group) of its own.
    At most MAX_CHILD_OUTPUT bytes are read from each stream (OutputCapExceeded beyond), and
    at most ``timeout`` seconds waited (subprocess.TimeoutExpired); either way, and whatever the
    child leaves running when it exits, the whole group is killed (a grandchild included)."""
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
    read = {fd: bytearray() for fd in names}
    deadline = time.monotonic() + timeout
    exited_at = None
    try:
        with selectors.DefaultSelector() as selector:
            for fd in names:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                now = time.monotonic()
                if exited_at is None and _exited(proc.pid):
                    exited_at = now
                    _kill_group(proc.pid)  # what it left behind; its pipes then close
                if exited_at is not None and now - exited_at > DRAIN_S:
                    break  # a process that left the group still holds a pipe
                if now >= deadline:
                    raise subprocess.TimeoutExpired(command, timeout)
                for key, _ in selector.select(min(deadline - now, POLL_S)):
                    chunk = os.read(key.fd, CHUNK)
                    if not chunk:
                        selector.unregister(key.fd)
                    elif len(read[key.fd]) + len(chunk) > MAX_CHILD_OUTPUT:
                        raise OutputCapExceeded(names[key.fd])
                    else:
                        read[key.fd] += chunk
        if exited_at is None:  # both pipes closed, the child runs on
            proc.wait(max(0.0, deadline - time.monotonic()))
    finally:
        _kill_group(proc.pid)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    out, err = (bytes(read[fd]).decode("utf-8", "replace") for fd in names)
    return proc.returncode, out, err


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
