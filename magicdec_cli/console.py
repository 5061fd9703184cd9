"""The one console of the CLI: Rich on stderr, quiet/JSON modes, rank-aware, progress for jobs.

Only this module writes to the terminal. Under tensor or data parallelism every rank but 0 stays
silent except for errors, so no `print` is ever rebound. Progress is a Rich bar on a terminal and a
plain log line every `LOG_EVERY_S` seconds otherwise (cron, CI, pipes), so logs stay readable.
"""

from __future__ import annotations

import os
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

LOG_EVERY_S = 30.0


def rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


class Out:
    def __init__(self, *, quiet: bool = False, json_mode: bool = False):
        self.quiet = quiet
        self.json_mode = json_mode
        self.err = Console(stderr=True, highlight=False)
        self.out = Console(highlight=False, soft_wrap=True)
        self.lead = rank() == 0

    @property
    def chatty(self) -> bool:
        return self.lead and not self.quiet and not self.json_mode

    def info(self, message: str) -> None:
        if self.chatty:
            self.err.print(message)

    def error(self, message: str) -> None:
        # One line whatever the terminal width (scripts grep it); escape the message's own brackets.
        from rich.markup import escape

        self.err.print(f"[bold red]magicdec: error:[/] {escape(message)}", soft_wrap=True, highlight=False)

    def table(self, title: str, rows: list[tuple[str, str]], *, stdout: bool = False) -> None:
        """A two-column table: on stderr beside progress, or on stdout when it is the command's output."""
        if not self.chatty:
            return
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for label, value in rows:
            table.add_row(label, value)
        (self.out if stdout else self.err).print(table)

    def progress(self) -> "JobProgress":
        return JobProgress(self)


class JobProgress:
    """The engine's ProgressSink: rows done / total, tokens/s, acceptance, ETA."""

    def __init__(self, out: Out):
        self.out = out
        self.enabled = out.chatty
        self.live = self.enabled and out.err.is_terminal
        self.bar: Progress | None = None
        self.task = None
        self.total = None
        self.last_log = time.time()

    def start(self, total: int | None, done: int) -> None:
        self.total = total
        if not self.enabled:
            return
        if self.live:
            self.bar = Progress(TextColumn("[bold]rows"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                console=self.out.err, transient=False)
            self.bar.start()
            self.task = self.bar.add_task("rows", total=total, completed=done, stats="")
        else:
            self.out.err.print(f"started: {total if total is not None else 'unknown number of'} rows"
                               + (f", {done} already done" if done else ""))

    def _stats_text(self, report, stats) -> str:
        tps = stats.decode_tokens / stats.decode_s if stats.decode_s else 0.0
        text = f"{tps:6.1f} tok/s"
        if stats.draft_tokens:
            text += f"  acc {stats.acceptance_rate:.2f}"
        if report.rows_failed:
            text += f"  [red]{report.rows_failed} failed[/]"
        return text

    def update(self, report, stats) -> None:
        if not self.enabled:
            return
        done = report.rows_ok + report.rows_failed + report.rows_resumed
        if self.bar is not None:
            self.bar.update(self.task, completed=done, stats=self._stats_text(report, stats))
        elif time.time() - self.last_log >= LOG_EVERY_S:
            self.last_log = time.time()
            total = f"/{self.total}" if self.total is not None else ""
            tps = stats.decode_tokens / stats.decode_s if stats.decode_s else 0.0
            line = f"progress: {done}{total} rows, {tps:.1f} decode tok/s"
            if stats.draft_tokens:
                line += f", acceptance {stats.acceptance_rate:.2f}"
            self.out.err.print(line)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def flush_all() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
