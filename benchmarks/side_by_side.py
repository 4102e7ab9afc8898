"""Subprocesses run side by side, each in a time box: the scheduling that gpu_check's
`pytest` section (test files) and `labs` section (notebooks under nbval) share.

    cut, unstarted = run_side_by_side(items, start, parallel, time_left, on_end, box_s=300)

A queue of items; ``start(item)`` turns one into a running ``Job``, at most ``parallel`` at
once, the next one as soon as a slot frees. Every ``poll_s`` seconds:

* a job whose process has exited goes to ``on_end(job)``, in the order they end;
* a job past its own box (``box_s``; None: no box) is stopped and goes to ``on_end`` with
  ``job.boxed`` set: the caller decides what a boxed job means (a failed lab);
* once ``time_left()`` (the section's) reaches 0 no job starts; the jobs still running are
  stopped and returned as cut, the items never started are returned as unstarted.

Invariants:

* Every job runs in a session of its own, and stopping it signals its whole process group:
  the job and what it started (a test's worker processes), so that nothing of it outlives
  the check. A child that makes a session of its own escapes that, and must end itself
  when its parent is gone: a notebook's kernel does (jupyter_client starts it so, and
  ipykernel's parent poller ends it).
* Whatever raises while jobs run (the section's SIGALRM, SIGTERM, SIGINT, an error in
  ``on_end``) stops every job still running before it propagates. A job is reported once:
  through ``on_end``, as cut, or not at all (when something raised).
* A job's output goes into temporary files, never a pipe: nobody reads a pipe while the
  others run, and a full one would stall its writer. ``on_end`` may read them
  (``job.output()``); they are closed once it returns, and a cut job's once it is stopped.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from typing import Any, Callable, Iterable

POLL_S = 0.2  # how often the running jobs are looked at
TERM_S = 5.0  # a stopped job's grace after SIGTERM, before SIGKILL
KILL_S = 10.0  # how long to wait for SIGKILL to be reaped before giving up on a job


class Job:
    """One command, started at once in a session of its own, its output (stdout and stderr,
    or both in one with ``merge_stderr``) in temporary files. ``item``: what it was started
    for; ``alongside``: the most other jobs running at once while it ran; ``boxed``: stopped
    by its own time box."""

    def __init__(self, item: Any, argv: list[str], *, env: dict | None = None,
                 cwd=None, merge_stderr: bool = False):
        self.item = item
        self.alongside = 0
        self.boxed = False
        self._out = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        self._err = (None if merge_stderr else
                     tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace"))
        self.t0, self._t1 = time.monotonic(), None
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._out,
                                     stderr=self._err or subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def seconds(self) -> float:
        """How long it ran: until it was seen to end (or was stopped), else until now."""
        return (self._t1 or time.monotonic()) - self.t0

    def ended(self) -> bool:
        """Whether its process has exited; the first time it is seen so, its clock stops."""
        if self.proc.poll() is None:
            return False
        self._stop_clock()
        return True

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) so far, until the job is closed; stderr is "" when merged."""
        self._out.seek(0)
        out = self._out.read()
        if self._err is None:
            return out, ""
        self._err.seek(0)
        return out, self._err.read()

    def close(self) -> None:
        for f in (self._out, self._err):
            if f is not None:
                f.close()

    def _stop_clock(self) -> None:
        if self._t1 is None:
            self._t1 = time.monotonic()


def stop(jobs: list[Job]) -> None:
    """End each job's process group: SIGTERM to all at once, SIGKILL to what is left after
    TERM_S, then reap. All at once, so that stopping many jobs costs one grace period, not
    one each; and every group is signalled before any wait, so a stop cut short (a second
    signal) has still told each one to end. Their clocks stop; their files stay open."""
    for sig, wait_s in ((signal.SIGTERM, TERM_S), (signal.SIGKILL, KILL_S)):
        alive = [job for job in jobs if job.proc.poll() is None]
        for job in alive:
            try:
                os.killpg(job.proc.pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait_s
        while any(job.proc.poll() is None for job in alive) and time.monotonic() < end:
            time.sleep(0.05)
    for job in jobs:
        job._stop_clock()


def run_side_by_side(items: Iterable, start: Callable[[Any], Job], parallel: int,
                     time_left: Callable[[], float], on_end: Callable[[Job], None],
                     box_s: float | None = None,
                     poll_s: float = POLL_S) -> tuple[list[Job], list]:
    """Run the items' jobs, ``parallel`` at a time (see the module's docstring). Returns
    (the jobs cut by the section's time, stopped, with how long they had run; the items
    never started). Whatever raises stops every job still running, then propagates."""
    if parallel < 1:
        raise ValueError(f"parallel must be at least 1 (jobs at once), got {parallel}")
    pending, running = list(items), []

    def report(job: Job) -> None:  # the job has left `running`: its files close here
        try:
            on_end(job)
        finally:
            job.close()

    try:
        while pending or running:
            while pending and len(running) < parallel and time_left() > 0:
                running.append(start(pending.pop(0)))
            if not running:  # no time left to start one: the rest stay unstarted
                break
            for job in running:
                job.alongside = max(job.alongside, len(running) - 1)
            time.sleep(poll_s)
            for job in list(running):
                if job.ended():
                    running.remove(job)
                    report(job)
                elif box_s is not None and job.seconds > box_s:
                    stop([job])
                    running.remove(job)
                    job.boxed = True
                    report(job)
            if running and time_left() <= 0:
                for job in list(running):  # one that ended meanwhile stands as ended
                    if job.ended():
                        running.remove(job)
                        report(job)
                stop(running)
                cut, running = running, []
                for job in cut:
                    job.close()
                return cut, pending
    finally:  # `running` is empty unless something raised
        stop(running)
        for job in running:
            job.close()
    return [], pending
