"""One job per output: an advisory lock file beside it, `<output>.lock`, held for the whole job.

`OutputLock.acquire` takes an exclusive `flock` on the file and writes who holds it (pid, host, start
time, command) into it; a second job on the same output gets a `JobError` naming that process. The
kernel drops a flock when its process ends in any way (SIGKILL included), so a lock left by a killed
job is stale by construction: the next job simply takes it. The file is removed on release (after
checking, on taking it, that the path still names the locked file, so a job that opened it just
before another removed it cannot hold a lock on a deleted file). Advisory only: it stops magicdec
jobs, not other programs. Without `fcntl` (not POSIX) there is no lock at all.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from engine.errors import JobError
from engine.job.io.common import one_line

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None


class OutputLock:
    def __init__(self, path: Path, fd: int | None):
        self.path = path  # the lock file, <output>.lock
        self._fd = fd

    @classmethod
    def acquire(cls, output: Path) -> OutputLock:
        path = output.with_name(output.name + ".lock")
        if fcntl is None:
            return cls(path, None)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise JobError(f"{output}: cannot create its folder ({one_line(exc)})") from None
        for _ in range(100):  # another job may remove the file between our open and our lock
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise JobError(f"{path}: cannot create the output's lock file ({one_line(exc)})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _holder(fd)
                os.close(fd)
                raise JobError(f"{output} is in use by another magicdec run ({holder}); wait for it to "
                               f"finish or stop it (its lock: {path.name})") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                _write_holder(fd)
                return cls(path, fd)
            os.close(fd)  # we locked a file another job had just removed: try the new one
        raise JobError(f"{path}: could not take the output's lock")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still holding it (see the module docstring)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _write_holder(fd: int) -> None:
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)[:300]}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
    except OSError:
        pass  # a full disk: the lock holds all the same, only the holder's name is missing


def _holder(fd: int) -> str:
    """Who holds the lock, from the file's contents, as 'pid 123 on host, since ...' (waiting a moment
    for a holder that has just taken the lock to write its name)."""
    for _ in range(40):
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
            return f"pid {info['pid']} on {info['host']}, since {info['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.025)
    return "a process that has not said who it is"
