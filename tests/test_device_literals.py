"""No lab chooses a device on its own: one cell of each solution notebook, the first code cell
(`widgets.lab_header(...)`), selects the device, and every other cell and every widget takes
it from there. A literal "cpu" or "cuda", or a `torch.cuda` call, anywhere else is how a lab
ends up measuring one device and plotting another; this test finds them. It also checks that
each quiz question marked against a measurement reads a value the notebook records.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from quizzes.questions import load_bank

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "solutions").glob("[0-9][0-9]-*.ipynb"))
WIDGETS = sorted((ROOT / "widgets").glob("*.py"))
LITERAL = re.compile(r"""(?<!\[)(["'])(cpu|cuda)(:\d+)?\1""")  # not a subscript: info["cpu"] is a key
CUDA_API = re.compile(r"\btorch\.cuda\b")


def _offences(text: str) -> list[str]:
    lines = []
    for n, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]  # a comment may name a device
        if LITERAL.search(code) or CUDA_API.search(code):
            lines.append(f"line {n}: {line.strip()}")
    return lines


def _code_cells(path: Path):
    nb = nbformat.read(path, as_version=4)
    return [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def test_the_pattern_finds_what_it_must():
    assert _offences('DEVICE = "cuda" if torch.cuda.is_available() else "cpu"')
    assert _offences("x.to('cuda:0')") and _offences("torch.cuda.synchronize()")
    assert not _offences("x.to(DEVICE)  # not 'cuda' here") and not _offences("cuda_graph=True")
    assert not _offences("info['machine']['cpu']")  # a key of a results file, not a device


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_first_code_cell_selects_the_device(path):
    first = _code_cells(path)[0][1]
    assert f'widgets.lab_header("{path.stem}"' in first, \
        f"{path.name}: its first code cell must print the device with widgets.lab_header({path.stem!r})"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_names_a_device_but_the_selecting_one(path):
    bad = [f"cell {i}, {o}" for i, src in _code_cells(path)[1:] for o in _offences(src)]
    assert not bad, (f"{path.name} names a device outside its first cell; take it from "
                     f"DEVICE (widgets.lab_header) or minillm.devices:\n  " + "\n  ".join(bad))


@pytest.mark.parametrize("path", WIDGETS, ids=lambda p: p.name)
def test_no_widget_names_a_device(path):
    bad = _offences(path.read_text(encoding="utf-8"))
    assert not bad, (f"widgets/{path.name} names a device; take it from the model "
                     f"(model.device) or minillm.devices:\n  " + "\n  ".join(bad))


def _recorded(source: str) -> set[str]:
    """The keyword names of every quizzes.record(...) call in a cell."""
    return {kw.arg for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "record"
            for kw in node.keywords}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_measured_quiz_value_is_recorded(path):
    recorded = set().union(*(_recorded(src) for _, src in _code_cells(path)))
    bank = load_bank(f"lab{path.stem[:2]}")
    needs = {k for q in bank.questions.values() for k in getattr(q, "needs", ()) or ()}
    assert needs <= recorded, f"{path.name} never records {sorted(needs - recorded)} for its quiz"
