"""benchmarks/side_by_side.py with tiny real subprocesses: at most `parallel` at once, a job
past its own box stopped with what it started, the section's time cutting the running jobs
and leaving the rest unstarted, and no process outliving an exception in the loop (an error
in the callback, a real SIGALRM). A few seconds in all."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from side_by_side import Job, run_side_by_side  # noqa: E402

POLL_S = 0.02
# Writes its start time, sleeps, then its end time: intervals to count overlaps in.
TIMED = """import sys, time
with open(sys.argv[1], "w") as f:
    f.write(f"{time.time()} ")
    f.flush()
    time.sleep(float(sys.argv[2]))
    f.write(f"{time.time()}")"""
# Starts a grandchild (in the same process group), writes its pid, then sleeps.
SPAWNS = """import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(60)"""


def sleeper(seconds: float):
    """start(item) for items that are names: a job sleeping `seconds`."""
    return lambda item: Job(item, [sys.executable, "-c", f"import time; time.sleep({seconds})"])


def forever() -> float:
    return 60.0


def gone(pid: int, wait_s: float = 5.0) -> bool:
    """Whether process `pid` has exited (reaped, or a zombie of init's) within `wait_s`."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


def test_at_most_parallel_jobs_run_at_once_and_each_is_reported_as_it_ends(tmp_path):
    files = [tmp_path / f"{i}" for i in range(5)]
    start = lambda f: Job(f, [sys.executable, "-c", TIMED, str(f), "0.3"])  # noqa: E731
    ended = []
    cut, unstarted = run_side_by_side(files, start, 2, forever, ended.append, poll_s=POLL_S)
    assert cut == [] and unstarted == []
    assert sorted(job.item for job in ended) == files
    assert all(job.proc.returncode == 0 and not job.boxed for job in ended)
    spans = [tuple(map(float, f.read_text().split())) for f in files]
    most = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert most == 2, spans  # side by side, never more than two
    assert max(job.alongside for job in ended) == 1


def test_a_job_past_its_own_box_is_stopped_with_what_it_started(tmp_path):
    pidfile = tmp_path / "child.pid"

    def start(item):
        if item == "quick":
            return Job(item, [sys.executable, "-c", "print('done')"])
        return Job(item, [sys.executable, "-c", SPAWNS, str(pidfile)])

    ended = []
    t0 = time.monotonic()
    cut, unstarted = run_side_by_side(["slow", "quick"], start, 2, forever, ended.append,
                                      box_s=1.0, poll_s=POLL_S)
    assert cut == [] and unstarted == []
    by = {job.item: job for job in ended}
    assert [job.item for job in ended] == ["quick", "slow"]
    assert not by["quick"].boxed and by["quick"].proc.returncode == 0
    assert by["slow"].boxed and by["slow"].proc.returncode == -signal.SIGTERM
    assert 1.0 < by["slow"].seconds < time.monotonic() - t0 < 5
    assert gone(int(pidfile.read_text())), "the boxed job's child outlived it"


def test_output_goes_to_files_and_a_large_one_does_not_stall(tmp_path):
    code = "import sys; sys.stdout.write('x' * 1_000_000); sys.stderr.write('to stderr')"
    outputs = []

    def ended(job):
        outputs.append(job.output())

    for merge in (False, True):
        run_side_by_side(["big"], lambda item: Job(item, [sys.executable, "-c", code],
                                                   merge_stderr=merge),
                         1, forever, ended, box_s=10.0, poll_s=POLL_S)
    (out, err), (merged, none) = outputs
    assert out == "x" * 1_000_000 and err == "to stderr"
    assert merged == out + err and none == ""


def test_the_sections_time_cuts_the_running_jobs_and_leaves_the_rest_unstarted():
    deadline = time.monotonic() + 1.0
    started, ended = [], []

    def start(item):
        started.append(item)
        return sleeper(0.0 if item == "quick" else 60)(item)

    cut, unstarted = run_side_by_side(["quick", "slow1", "slow2", "later"], start, 2,
                                      lambda: deadline - time.monotonic(), ended.append,
                                      box_s=30.0, poll_s=POLL_S)
    assert [job.item for job in ended] == ["quick"]
    assert [job.item for job in cut] == ["slow1", "slow2"]
    assert all(job.proc.returncode == -signal.SIGTERM for job in cut)
    assert all(0.5 < job.seconds < 3 for job in cut)
    assert unstarted == ["later"] and started == ["quick", "slow1", "slow2"]
    # With no time left nothing starts.
    cut, unstarted = run_side_by_side(["a", "b"], start, 2, lambda: 0.0, ended.append)
    assert cut == [] and unstarted == ["a", "b"] and len(started) == 3


def test_an_error_in_the_callback_stops_every_running_job(tmp_path):
    jobs = []

    def start(item):
        jobs.append(sleeper(0.0 if item == "quick" else 60)(item))
        return jobs[-1]

    def ended(job):
        raise RuntimeError("the report could not be written")

    with pytest.raises(RuntimeError, match="could not be written"):
        run_side_by_side(["slow1", "quick", "slow2"], start, 3, forever, ended, poll_s=POLL_S)
    assert [job.item for job in jobs] == ["slow1", "quick", "slow2"]
    assert all(job.proc.poll() is not None for job in jobs)
    assert [job.proc.returncode for job in jobs] == [-signal.SIGTERM, 0, -signal.SIGTERM]


class Alarm(Exception):
    pass


def test_a_signal_in_the_loop_stops_every_job_and_what_it_started(tmp_path):
    """As the section's SIGALRM does: raised between polls, wherever the loop is."""
    jobs = []

    def start(item):
        jobs.append(Job(item, [sys.executable, "-c", SPAWNS, str(tmp_path / item)]))
        return jobs[-1]

    def alarm(signum, frame):
        raise Alarm

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(Alarm):
            run_side_by_side(["a", "b", "c"], start, 2, forever, lambda job: None,
                             poll_s=POLL_S)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert [job.item for job in jobs] == ["a", "b"]
    assert all(job.proc.poll() is not None for job in jobs)
    for item in ("a", "b"):
        if (tmp_path / item).exists():  # the grandchild started before the alarm
            assert gone(int((tmp_path / item).read_text())), f"{item}'s child outlived it"


def test_parallel_must_be_at_least_one():
    with pytest.raises(ValueError, match="parallel must be at least 1"):
        run_side_by_side(["a"], sleeper(0), 0, forever, lambda job: None)
