"""Fault injection for tests that run magicdec in a subprocess, loaded only there (the tests put this
folder on PYTHONPATH). Nothing in magicdec itself knows about this.

- MAGICDEC_TEST_DIE_AFTER_ROWS=N: a rank other than 0 kills itself (os._exit(9)) after N rows, the
  way a crashed or OOM-killed worker disappears. A group leader dies right after writing its N-th
  row; a tensor-parallel follower at the first request it pulls after its engine finished N rows.
- MAGICDEC_TEST_ENOSPC_AFTER_ROWS=N: the disk fills up after N JSONL output lines: the next line is
  half written, then the write fails with ENOSPC (as a full file system does).
"""

import errno
import os
import sys

DIE_AFTER = int(os.environ.get("MAGICDEC_TEST_DIE_AFTER_ROWS", "0") or 0)
ENOSPC_AFTER = int(os.environ.get("MAGICDEC_TEST_ENOSPC_AFTER_ROWS", "0") or 0)

if DIE_AFTER or ENOSPC_AFTER:
    # The tests start magicdec from the checkout's root: patch that checkout's modules, not those of
    # whatever install site-packages points at (sys.path has no '' yet while site runs).
    sys.path.insert(0, os.getcwd())

if ENOSPC_AFTER:
    from engine.job.io import jsonl_lines as _jsonl_lines

    _append_all, _lines = _jsonl_lines.append_all, [0]

    def _full_disk(fd, data):
        if _lines[0] >= ENOSPC_AFTER:
            _append_all(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _lines[0] += 1
        _append_all(fd, data)

    _jsonl_lines.append_all = _full_disk

if DIE_AFTER and os.environ.get("RANK", "0") not in ("", "0"):
    from engine.scale import run as _scale_run

    _run_job, _load_engine = _scale_run.run_job, _scale_run.load_engine

    class _DieAfterRows:
        """The leader's progress sink, wrapped: it is told of every row once that row is written."""

        def __init__(self, inner):
            self.inner = inner

        def start(self, total, done, **kwargs):
            self.inner.start(total, done, **kwargs)

        def update(self, report, stats):
            self.inner.update(report, stats)
            if report.rows_ok + report.rows_failed >= DIE_AFTER:
                os._exit(9)

        def finish(self):
            self.inner.finish()

    def _dying_run_job(options, progress=None, **kwargs):
        return _run_job(options, _DieAfterRows(progress), **kwargs)

    def _dying_load_engine(*args, **kwargs):
        engine = _load_engine(*args, **kwargs)
        run = engine.run

        def dying_run(requests):
            finished = 0

            def pulls():
                for request in requests:
                    yield request
                    if finished >= DIE_AFTER:
                        os._exit(9)

            for result in run(pulls()):
                finished += 1
                yield result

        engine.run = dying_run
        return engine

    _scale_run.run_job, _scale_run.load_engine = _dying_run_job, _dying_load_engine
