"""Grade submitted notebooks, exercise by exercise.

    python -m quizzes.grade SUBMISSIONS_DIR [--release-dir labs] [--out grading-out]
                            [--timeout 300] [--setup-timeout 600] [--jobs 1]

For every ``*.ipynb`` under SUBMISSIONS_DIR (nested per student or flat):
1. match it to a release notebook ``labs/NN-topic.ipynb`` by name (the release
   stem inside the file name, else a unique ``NN-`` prefix);
2. build a fresh copy of the release notebook and carry over ONLY the
   student's ``exercise:<id>`` cells (found by tag, else by cell id), so
   edited or deleted checks do not count: the release's check cells run;
3. run it with nbclient, cell by cell; exercise and check cells get
   ``--timeout`` seconds, the lab's own cells ``--setup-timeout``;
4. score each exercise: points × (its check cells that ran without error ÷ its
   check cells);
5. score each quiz question the notebook asks (``quizzes.show``/``quizzes.predict``):
   1 point when the student's FIRST answer, kept in the submission's output metadata
   (and in the grader's ledger ``OUT/answers.json`` from earlier submissions), is right;
   predictions are marked against the measurements of this graded run (see
   ``quizzes.quiz_grading``).

A cell that times out (or kills the kernel) stops the run; its exercise gets
0 ("timeout"), its cell is replaced by the release stub and the notebook is
run again, so the other exercises are still graded on a clean kernel.
Unreadable or unmatched files are reported as rows, never as a crash.

Writes ``OUT/scores.csv`` (one line per submission: totals, then a column per exercise
and per question), ``OUT/details.csv`` (one line per submission × exercise or question,
with status and detail), ``OUT/answers.json`` (the first answers kept so far), and per
submission ``OUT/<student>/<name>.graded.ipynb`` (the run, with outputs) and
``.feedback.txt``; prints a summary. Exit code 0 unless nothing could be graded
because the release notebooks are missing.

Here: running and scoring one notebook, and the command. Finding, matching and
assembling submissions is ``quizzes.submissions``; the rows, ``scores.csv``, the
feedback files and the summary are ``quizzes.scores`` (both re-exported here).

Caveat: submissions are arbitrary code; grade inside a throwaway container.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import nbformat

from . import kept
from .quiz_grading import (add_measured_cell, asked_questions, load_ledger, merged_answers, quiz_rows,
                           record_in_ledger, save_ledger, submitted_answers)
from .release import Layout, layout
from .scores import CSV_FIELDS, Outcome, Row, summary, write_details, write_feedback, write_scores
from .submissions import assemble, find_submissions, match_release, student_exercises, student_name

__all__ = ["grade_all", "grade_notebook", "execute", "main",
           "CSV_FIELDS", "Row", "Outcome", "summary",  # from .scores
           "find_submissions", "match_release", "student_name", "student_exercises", "assemble"]  # from .submissions


# ----------------------------------------------------------------------- running


def execute(nb, lay: Layout, cwd: Path, timeout: float, setup_timeout: float) -> tuple[int | None, str]:
    """Run the cells in order. Returns (index of the cell that stopped the run, why) or (None, "")."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    graded = set(lay.exercise_cell.values()) | {i for cells in lay.check_cells.values() for i in cells}

    def timeout_for(cell) -> int:
        idx = cell_index[id(cell)]
        return int(timeout if idx in graded else setup_timeout)

    cell_index = {id(c): i for i, c in enumerate(nb.cells)}
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout_func=timeout_for,
        allow_errors=True,
        interrupt_on_timeout=False,
        shutdown_kernel="immediate",
        startup_timeout=180,
        resources={"metadata": {"path": str(cwd)}},
    )
    # the kernel keeps no answers of its own: no sidecar file, nothing read from a notebook
    env = {k: v for k, v in os.environ.items() if k != "JPY_SESSION_NAME"}
    with client.setup_kernel(env={**env, "QUIZZES_ANSWERS": "off"}):
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            try:
                client.execute_cell(cell, i)
            except CellTimeoutError:
                return i, "timeout"
            except DeadKernelError:
                return i, "crashed"
    return None, ""


def _error(cell) -> tuple[str, str] | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return out.get("ename", "Error"), out.get("evalue", "")
    return None


def _first_lines(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " / ".join(ln.strip() for ln in lines[:n])


def grade_notebook(path: Path, root: Path, releases: dict[str, Path], timeout: float, setup_timeout: float,
                   cwd: Path | None = None, earlier: dict[str, dict] | None = None) -> Outcome:
    """Grade one submission. ``earlier``: first answers the ledger kept for this student and lab."""
    rel = str(path.relative_to(root))
    release_path = match_release(path, releases)
    student = student_name(path, root, release_path.stem if release_path else None)
    if release_path is None:
        return Outcome([Row(student, rel, "-", "-", 0, 0, "unmatched",
                            f"no release notebook matches this file name (known: {', '.join(sorted(releases))})")])
    nbname = release_path.stem
    try:
        with warnings.catch_warnings():  # students' notebooks often lack cell ids etc.; not their problem
            warnings.simplefilter("ignore")
            student_nb = nbformat.read(path, as_version=4)
        if not isinstance(student_nb.get("cells"), list):
            raise ValueError("no cells")
    except Exception as exc:
        return Outcome([Row(student, rel, nbname, "-", 0, 0, "unreadable",
                            f"not a readable notebook ({type(exc).__name__}: {_first_lines(str(exc), 1)[:200]})")])
    release_nb = nbformat.read(release_path, as_version=4)
    lay = layout(release_nb, str(release_path))
    sources, missing = student_exercises(student_nb, release_nb, lay)
    qids = asked_questions(release_nb)
    answers = merged_answers(earlier or {}, submitted_answers(student_nb), qids)
    base = (student, rel, nbname)

    def finish(rows: list[Row], run, passes: int, notes: list[str]) -> Outcome:
        measured = kept.measured_in_notebook(run) if run is not None else None
        rows = rows + quiz_rows(base, qids, answers, measured, student_nb)
        return Outcome(rows, run, passes, notes, answers, f"{student}|{nbname}")

    stubbed: dict[str, str] = {}  # exercise -> "timeout"/"crashed"
    blanked: set[int] = set()
    notes: list[str] = []
    owner = {i: ex for ex, cells in lay.check_cells.items() for i in cells}
    owner.update({i: ex for ex, i in lay.exercise_cell.items()})
    nb = None
    stop: int | None = None
    passes = 0
    for passes in range(1, len(lay.exercises) + len(release_nb.cells) + 2):
        nb = assemble(release_nb, lay, sources, set(stubbed), blanked)
        add_measured_cell(nb)
        try:
            stop, why = execute(nb, lay, cwd or release_path.parent, timeout, setup_timeout)
        except Exception as exc:  # kernel would not start, etc.
            rows = [Row(student, rel, nbname, ex, 0, lay.points[ex], "error",
                        f"the grader could not run the notebook: {type(exc).__name__}: {exc}")
                    for ex in lay.exercises]
            return finish(rows, None, passes, notes)
        if stop is None:
            break
        if stop >= len(release_nb.cells):  # the grader's own last cell: the lab's cells all ran
            notes.append(f"run {passes}: the grader's measurement cell {why}; predictions are not measured")
            stop = None
            break
        ex = owner.get(stop)
        if ex is not None and ex not in stubbed:
            stubbed[ex] = why
            notes.append(f"run {passes}: cell {stop} ({ex}) {why}; re-running with the stub for {ex}")
        else:
            blanked.add(stop)
            notes.append(f"run {passes}: cell {stop} (not an exercise) {why}; re-running without it")
    rows = [_score(ex, lay, nb, stubbed, missing, student, rel, nbname, timeout, stop) for ex in lay.exercises]
    return finish(rows, nb, passes, notes)


def _score(ex: str, lay: Layout, nb, stubbed: dict[str, str], missing: set[str], student: str, rel: str,
           nbname: str, timeout: float, stop: int | None) -> Row:
    pts = lay.points[ex]
    checks = lay.check_cells[ex]
    base = (student, rel, nbname, ex)
    if ex in stubbed:
        what = "ran longer than" if stubbed[ex] == "timeout" else "crashed the kernel within"
        return Row(*base, 0, pts, stubbed[ex], f"your code {what} {timeout:g} s (an infinite loop?); "
                                               "this exercise gets 0, the others were graded without it")
    ok, failures = 0, []
    for i in checks:
        cell = nb.cells[i]
        err = _error(cell)
        if cell.get("execution_count") is None and err is None:
            failures.append(("NotRun", "this check did not run"))
        elif err is None:
            ok += 1
        else:
            failures.append(err)
    score = round(pts * ok / len(checks), 4)
    if ok == len(checks):
        return Row(*base, score, pts, "pass", "")
    ex_err = _error(nb.cells[lay.exercise_cell[ex]])
    if ex in missing:
        status, detail = "missing", f"no cell tagged exercise:{ex} in the submission (the stub was graded)"
    elif ex_err is not None:
        status, detail = "error", f"your exercise cell raised {ex_err[0]}: {_first_lines(ex_err[1], 1)}"
    elif any(name == "NotImplementedYet" for name, _ in failures):
        status, detail = "not implemented", "the function still raises NotImplementedError"
    else:
        name, msg = failures[0]
        status = "partial" if ok else "fail"
        detail = f"{name}: {_first_lines(msg)}" if msg else name
    return Row(*base, score, pts, status, detail[:500])


# ----------------------------------------------------------------------- the command


def _grade_one(args: tuple) -> tuple[str, Outcome]:
    path, root, releases, timeout, setup_timeout, cwd, earlier = args
    t0 = time.monotonic()
    try:
        out = grade_notebook(path, root, releases, timeout, setup_timeout, cwd, earlier)
    except Exception as exc:  # one odd submission must not stop the batch
        rel = str(path.relative_to(root))
        matched = match_release(path, releases)
        out = Outcome([Row(student_name(path, root, matched.stem if matched else None), rel,
                           matched.stem if matched else "-", "-", 0, 0, "unreadable",
                           f"the grader failed on this file: {type(exc).__name__}: {_first_lines(str(exc), 1)[:200]}")])
    out.notes.append(f"graded in {time.monotonic() - t0:.1f} s")
    return str(path), out


def grade_all(submissions: Path, release_dir: Path, out_dir: Path, timeout: float = 300,
              setup_timeout: float = 600, jobs: int = 1, cwd: Path | None = None, log=print) -> list[Row]:
    releases = {p.stem: p for p in sorted(release_dir.glob("*.ipynb"))}
    if not releases:
        raise SystemExit(f"no release notebooks in {release_dir}/ (run `make labs` first)")
    root = submissions if submissions.is_dir() else submissions.parent
    paths = find_submissions(submissions)
    ledger = load_ledger(out_dir)
    work = [(p, root, releases, timeout, setup_timeout, cwd, ledger.get(_ledger_key(p, root, releases), {}))
            for p in paths]
    if jobs > 1 and len(work) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_grade_one, work))
    else:
        results = [_grade_one(w) for w in work]
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for path_str, outcome in results:
        rows.extend(outcome.rows)
        write_feedback(Path(path_str), root, out_dir, outcome)
        if outcome.key and outcome.answers:
            record_in_ledger(ledger, outcome.key, outcome.answers)
    write_scores(rows, out_dir / "scores.csv")
    write_details(rows, out_dir / "details.csv")
    save_ledger(out_dir, ledger)
    log(summary(rows))
    log(f"\nwrote {out_dir / 'scores.csv'} (a line per submission) and {out_dir / 'details.csv'} (a line per item)")
    return rows


def _ledger_key(path: Path, root: Path, releases: dict[str, Path]) -> str:
    matched = match_release(path, releases)
    stem = matched.stem if matched else "-"
    return f"{student_name(path, root, matched.stem if matched else None)}|{stem}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quizzes.grade", description=__doc__.split("\n\n")[0])
    ap.add_argument("submissions", type=Path, help="a folder of submitted notebooks (or one notebook)")
    ap.add_argument("--release-dir", type=Path, default=Path("labs"))
    ap.add_argument("--out", type=Path, default=Path("grading-out"))
    ap.add_argument("--timeout", type=float, default=300, help="seconds per exercise/check cell (default 300)")
    ap.add_argument("--setup-timeout", type=float, default=600, help="seconds per other cell (default 600)")
    ap.add_argument("--jobs", type=int, default=1, help="notebooks graded in parallel (default 1)")
    args = ap.parse_args(argv)
    if not args.submissions.exists():
        print(f"error: {args.submissions} does not exist", file=sys.stderr)
        return 2
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    grade_all(args.submissions, args.release_dir, args.out, args.timeout, args.setup_timeout, args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
