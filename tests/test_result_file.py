"""benchmarks/result_file.py: a result file round-trips with its provenance, is replaced
atomically, refuses to overwrite a "provenance" key, and is written without git."""
from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import result_file  # noqa: E402

from minillm.devices import device_name  # noqa: E402

FIELDS = {"command", "env", "date_utc", "device", "cpu", "platform", "cpu_count",
          "torch_threads", "versions", "commit"}


def test_round_trip_keeps_every_key_and_adds_the_provenance(tmp_path):
    data = {"benchmark": "x", "date": "2026-11-27 10:00", "rows": [{"t": 1, "ms": 0.5}]}
    path = tmp_path / "deep" / "er" / "x.json"  # parent directories are created
    got = result_file.write_result(path, data, argv=["benchmarks/x.py", "--rounds", "3"],
                                   indent=1)
    assert got == path
    text = path.read_text()
    back = json.loads(text)
    assert {k: back[k] for k in data} == data
    assert list(back) == [*data, "provenance"]  # the script's keys first, in their order
    assert text == json.dumps(back, indent=1) + "\n"  # the indent asked for, a final newline
    assert "provenance" not in data  # the caller's dict is left alone


def test_provenance_names_command_date_machine_versions_and_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "default")
    monkeypatch.setenv("SOME_API_TOKEN", "secret")
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    script = str(ROOT / "benchmarks" / "decode.py")  # absolute: recorded from the root
    path = result_file.write_result(tmp_path / "r.json", {"a": 1},
                                    argv=[script, "--rounds", "3", "--note", "two words"])
    prov = json.loads(path.read_text())["provenance"]
    assert set(prov) == FIELDS
    assert prov["command"] == "python benchmarks/decode.py --rounds 3 --note 'two words'"
    assert prov["env"]["MINILLM_CPU_KERNEL"] == "default" and "SOME_API_TOKEN" not in prov["env"]
    when = datetime.datetime.strptime(prov["date_utc"], "%Y-%m-%dT%H:%M:%SZ")
    assert when.replace(tzinfo=datetime.timezone.utc) >= before
    assert prov["device"] == prov["cpu"] == device_name("cpu")  # the CPU by default
    assert prov["cpu_count"] >= 1 and prov["torch_threads"] >= 1
    assert set(prov["versions"]) == {"python", "torch", "triton", "numpy"}
    assert prov["versions"]["torch"] and prov["versions"]["python"].count(".") == 2
    # A tree copied without .git (a device machine) records None; a checkout, its HEAD.
    assert prov["commit"] is None or re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", prov["commit"])


def test_command_defaults_to_sys_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/glue.py", "--rows", "1"])
    assert result_file.command() == "python benchmarks/glue.py --rows 1"
    assert result_file.command(["-c"]) == "python -c"  # not a file: kept as it is


def test_a_list_is_wrapped_with_its_provenance(tmp_path):
    path = result_file.write_result(tmp_path / "l.json", [1, 2, 3], argv=["x.py"])
    back = json.loads(path.read_text())
    assert set(back) == {"provenance", "results"} and back["results"] == [1, 2, 3]


def test_a_provenance_key_of_the_script_is_refused_and_nothing_written(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"old": true}\n')
    with pytest.raises(ValueError, match="already has a 'provenance' key"):
        result_file.write_result(path, {"provenance": "mine"}, argv=["x.py"])
    assert path.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_an_unencodable_value_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"old": true}\n')
    with pytest.raises(TypeError):
        result_file.write_result(path, {"rows": [object()]}, argv=["x.py"])
    assert path.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_a_write_cut_before_the_rename_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text('{"old": true}\n')

    def cut(*args):
        raise KeyboardInterrupt  # the run stopped between writing and renaming

    monkeypatch.setattr(result_file.os, "replace", cut)
    with pytest.raises(KeyboardInterrupt):
        result_file.write_result(path, {"new": True}, argv=["x.py"])
    assert path.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_a_successful_write_leaves_only_the_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"old": true}\n')
    result_file.write_result(path, {"new": True}, argv=["x.py"])
    assert json.loads(path.read_text())["new"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.parametrize("failure", [FileNotFoundError("git"),
                                     subprocess.TimeoutExpired("git", 10),
                                     subprocess.CalledProcessError(128, "git")])
def test_without_git_the_commit_is_none_and_the_file_is_written(tmp_path, monkeypatch, failure):
    def no_git(*args):
        raise failure

    monkeypatch.setattr(result_file, "_git", no_git)
    path = result_file.write_result(tmp_path / "r.json", {"a": 1}, argv=["x.py"])
    assert json.loads(path.read_text())["provenance"]["commit"] is None


def fake_git(top: str, status: str):
    def run(*args):
        if args[0] == "rev-parse":
            return f"{top}\nabc1234\n"
        assert args[:3] == ("status", "--porcelain", "--untracked-files=no")
        assert ":(exclude)benchmarks/results" in args  # a rewritten result is not a change
        return status
    return run


def test_commit_is_the_short_hash_dirty_when_tracked_files_changed(monkeypatch):
    monkeypatch.setattr(result_file, "_git", fake_git(str(result_file.ROOT), ""))
    assert result_file.git_commit() == "abc1234"
    monkeypatch.setattr(result_file, "_git", fake_git(str(result_file.ROOT), " M minillm/x.py\n"))
    assert result_file.git_commit() == "abc1234+dirty"


def test_a_tree_inside_another_repository_records_no_commit(monkeypatch, tmp_path):
    monkeypatch.setattr(result_file, "_git", fake_git(str(tmp_path), ""))
    assert result_file.git_commit() is None


def test_result_writing_scripts_go_through_write_result():
    """Every benchmark that writes a result JSON uses result_file, so each file records its
    command, date, machine and commit. Left out: the GPU check's own atomic report writer,
    files that are inputs or tables rather than results (workload.json, the labs' runtimes,
    the pinned configs)."""
    others = {"gpu_check.py", "gpu_step_profile.py", "lab_runtimes.py", "workload.py",
              "pin_configs.py", "result_file.py"}
    inline = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py"))
              if p.name not in others and re.search(r"write_text\(\s*json\.dumps", p.read_text())]
    assert not inline, f"{inline}: write the result with result_file.write_result"
