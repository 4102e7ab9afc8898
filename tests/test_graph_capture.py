"""No garbage collection inside a CUDA graph capture (`minillm.graph_capture`).

A dead engine in a reference cycle is freed when the cyclic collector runs; if that happens
while a stream captures, freeing its graphs invalidates the capture. On an H200 a second
engine's capture failed that way after a test had dropped the first. On a CPU these tests
check the guard itself and that every capture in the package is wrapped in it; on CUDA the
last one checks that each capture of an engine and of generate begins with the collector
off, while a dead engine waits for it.
"""
import gc
import pathlib
import re
import weakref

import pytest
import torch

import minillm
from minillm import LlamaModel, ModelConfig
from minillm.engine import LLMEngine, SamplingParams
from minillm.graph_capture import capture_guard

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "minillm"
CUDA = torch.cuda.is_available()


def _garbage_cycle() -> tuple[list, weakref.ref]:
    """An object only the cyclic collector can free; the list gets True when it does (keep
    the weakref alive)."""
    class Cycle:
        pass

    a = Cycle()
    a.self = a
    collected = []
    return collected, weakref.ref(a, lambda _: collected.append(True))


def test_the_guard_collects_first_and_pauses_the_collector():
    collected, watch = _garbage_cycle()  # noqa: F841 (kept alive)
    assert gc.isenabled()
    with capture_guard():
        assert collected == [True], "garbage in cycles is freed before the capture"
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_guard_can_leave_the_collection_out():
    collected, watch = _garbage_cycle()  # noqa: F841 (kept alive)
    with capture_guard(collect=False):
        assert collected == [] and not gc.isenabled()  # off, and nothing collected
    assert gc.isenabled()
    gc.collect()
    assert collected == [True]


def test_the_guard_restores_the_collector_after_an_error_and_as_it_found_it():
    with pytest.raises(RuntimeError, match="broken"):
        with capture_guard():
            raise RuntimeError("broken")
    assert gc.isenabled()
    gc.disable()
    try:
        with capture_guard():
            pass
        assert not gc.isenabled(), "a collector that was off stays off"
    finally:
        gc.enable()


def test_every_capture_in_the_package_is_guarded():
    """Each module that captures (`torch.cuda.graph(` or `capture_begin(`) imports the guard
    and enters it (that the captures run inside it, the CUDA test below checks)."""
    captures = re.compile(r"torch\.cuda\.graph\(|\.capture_begin\(")
    found = {}
    for path in PACKAGE.rglob("*.py"):
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        code = re.sub(r'"""[\s\S]*?"""', "", code)  # docstrings mention captures too
        if captures.search(code) and path.name != "graph_capture.py":
            found[path.relative_to(PACKAGE).as_posix()] = code
    assert set(found) >= {"engine/cuda_graph.py", "engine/piecewise.py", "decode_graph.py",
                          "timing.py"}
    for name, code in found.items():
        assert re.search(r"^from \S+ import capture_guard$", code, re.M), name
        assert "with capture_guard(" in code, f"{name} captures outside capture_guard()"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: on a CPU nothing is captured")
def test_an_engine_and_generate_capture_with_the_collector_off(monkeypatch):
    """Every capture_begin of a real engine (decode graphs and piecewise pieces) and of
    generate's decode graph runs with the collector off, and a dead engine waiting for it
    does not break them. (When the collector runs is up to Python: the test checks the
    state each capture began in rather than hoping for a collection.)"""
    began = []

    class Recorded(torch.cuda.CUDAGraph):
        def capture_begin(self, *args, **kw):
            began.append(gc.isenabled())
            return super().capture_begin(*args, **kw)

    model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval().to("cuda")
    model.set_attn_backend("triton")
    kw = {"num_blocks": 200, "block_size": 4, "max_num_batched_tokens": 48}
    dead = LLMEngine(model, **kw)
    dead.cycle = dead  # only the cyclic collector can free it (and its graphs)
    del dead
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Recorded)
    e = LLMEngine(model, **kw)
    assert e.runner.graphs.graphs and e.runner.pieces is not None and e.runner.pieces.graphs
    out = e.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4 and e.runner.graphs.num_replays > 0
    n_engine = len(began)
    assert n_engine > 3 and not any(began), began
    minillm.generate(model, [5, 6, 7], 4, ignore_eos=True, cuda_graph=True)
    assert len(began) > n_engine and not any(began), "generate's capture"
    assert gc.isenabled()
