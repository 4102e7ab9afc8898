"""Drive JupyterLab in headless Chromium, for notebook tests that need a real browser.

Fixtures (import them into a test module: ``from browser_utils import jupyter_lab, lab``):

- ``jupyter_lab`` (session): a JupyterLab server on 127.0.0.1, a free port, a
  random token, a temporary root/config/settings dir (news off, autosave off,
  every cell rendered), ``--allow-root`` when root. Killed by pid at the end,
  together with the kernels it started.
- ``lab`` (function): a ``LabPage`` in a fresh Chromium page (Debian's
  ``chromium`` via ``executable_path``; never ``playwright install``).

Typical test::

    def test_lab02(lab):
        lab.open("solutions/02-kv-cache.ipynb")   # copied into the server's root
        lab.run_all()
        assert lab.errors() == []
        lab.screenshot("lab02-after-run")
        lab.page.locator(".quiz-q-lab02-q1 .quiz-input input").fill("1.34 GB")

Without chromium the fixtures skip, naming the fix (``bash .ci/install-browser.sh``);
with the ``CI`` environment variable set they fail instead, so a CI run cannot
pass by skipping.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
INSTALL_HINT = "bash .ci/install-browser.sh"


def require_browser() -> str:
    """Path of chromium, or skip (fail under CI) with the fix spelled out."""
    problem = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        problem = "the playwright Python package is missing (pip install -e '.[test]')"
    exe = shutil.which("chromium")
    if problem is None and exe is None:
        problem = f"no `chromium` on PATH: run `{INSTALL_HINT}` (Debian's chromium; never `playwright install`)"
    if problem:
        msg = f"BROWSER TESTS NOT RUN: {problem}"
        if os.environ.get("CI"):
            pytest.fail(msg + " [CI is set, so this is a failure, not a skip]", pytrace=False)
        pytest.skip(msg)
    return exe  # type: ignore[return-value]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Direct children of pid (Linux /proc), e.g. the kernels of a Jupyter server."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


class JupyterLabServer:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.root = workdir / "root"
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "jupyterlab.log"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.base}/lab/tree/{path}?token={self.token}"

    def shut_down_kernels(self, path: str) -> None:
        """End the sessions (and kernels) an earlier test left open on notebook `path`."""
        import urllib.request

        def call(method: str, route: str):
            req = urllib.request.Request(f"{self.base}/api/{route}?token={self.token}",
                                         method=method)
            with urllib.request.urlopen(req, timeout=30) as resp:
                body = resp.read()
            return json.loads(body) if body else None

        for session in call("GET", "sessions") or []:
            if session.get("path") == path:
                call("DELETE", f"sessions/{session['id']}")

    def _write_settings(self, settings: Path) -> None:
        files = {
            "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                               "checkForUpdates": False},
            "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
            "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
        }
        for rel, content in files.items():
            p = settings / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(content))

    def start(self, timeout: float = 120) -> None:
        for d in ("root", "config", "data", "runtime", "settings", "workspaces", "ipython"):
            (self.workdir / d).mkdir(parents=True, exist_ok=True)
        self._write_settings(self.workdir / "settings")
        env = dict(os.environ)
        env.update(JUPYTER_CONFIG_DIR=str(self.workdir / "config"), JUPYTER_DATA_DIR=str(self.workdir / "data"),
                   JUPYTER_RUNTIME_DIR=str(self.workdir / "runtime"), IPYTHONDIR=str(self.workdir / "ipython"),
                   JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               f"--LabApp.user_settings_dir={self.workdir / 'settings'}",
               f"--LabApp.workspaces_dir={self.workdir / 'workspaces'}",
               "--ServerApp.terminals_enabled=False"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/api/status?token={self.token}", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"JupyterLab did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def api(self, path: str):
        with urllib.request.urlopen(f"{self.base}/api/{path}?token={self.token}", timeout=10) as r:
            return json.loads(r.read())

    def kernel_state(self, notebook_path: str) -> str | None:
        try:
            for sess in self.api("sessions"):
                if sess.get("path") == notebook_path and sess.get("kernel"):
                    return sess["kernel"].get("execution_state")
        except OSError:
            return None
        return None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL), then any kernel it left behind."""
        if self.proc is None:
            return
        pid = self.proc.pid
        kernels = _children(pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for kpid in kernels:
            try:
                os.kill(kpid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
        self.proc = None


class LabPage:
    """One browser page on the server, with the steps notebook tests need."""

    def __init__(self, page, server: JupyterLabServer):
        self.page = page
        self.server = server
        self.path: str | None = None

    # -- files -------------------------------------------------------------------
    def open(self, notebook: str | Path, extra_files: tuple[str | Path, ...] = ()) -> None:
        """Copy ``notebook`` (path relative to the repo, or absolute) into the server root and open it."""
        src = Path(notebook)
        src = src if src.is_absolute() else REPO / src
        for f in [Path(e) if Path(e).is_absolute() else REPO / e for e in extra_files]:
            shutil.copy(f, self.server.root / f.name)
        nb = json.loads(src.read_text(encoding="utf-8"))
        for cell in nb.get("cells", []):  # start clean: every prompt "[ ]"
            if cell.get("cell_type") == "code":
                cell["outputs"], cell["execution_count"] = [], None
        (self.server.root / src.name).write_text(json.dumps(nb, indent=1), encoding="utf-8")
        # ...with no answers kept by an earlier test that opened the same notebook in this
        # session's server: neither its sidecar (quizzes.kept) nor its kernel, which still
        # holds them in memory and which JupyterLab would reattach to this path.
        (self.server.root / f".{src.stem}.answers.json").unlink(missing_ok=True)
        self.server.shut_down_kernels(src.name)
        self.path = src.name
        # `reset` starts from an empty workspace: the server is shared by the whole session,
        # and a restored tab from an earlier test would hide this notebook behind it.
        self.page.goto(self.server.url(self.path) + "&reset")
        self.page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
        self._accept_kernel_dialog()
        self.wait_idle(120)

    def _accept_kernel_dialog(self) -> None:
        dialog = self.page.locator(".jp-Dialog")
        try:
            dialog.wait_for(timeout=1500)
        except Exception:
            return
        if "kernel" in dialog.inner_text().lower():
            dialog.locator(".jp-mod-accept").click()

    # -- running -----------------------------------------------------------------
    def prompts(self) -> list[str]:
        return [t.strip() for t in self.page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()]

    def kernel_state(self) -> str | None:
        """The server's view of this notebook's kernel ("idle", "busy", "starting") or None."""
        return self.server.kernel_state(self.path or "")

    def wait_idle(self, timeout: float = 120) -> None:
        """Wait until the server reports the kernel idle, the page agrees, and no cell shows [*]."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.kernel_state() == "idle" and self._status() == "idle"
                    and not any("*" in p for p in self.prompts())):
                return
            time.sleep(0.3)
        raise TimeoutError(f"kernel not idle after {timeout:.0f} s (server: {self.kernel_state()}, "
                           f"page: {self._status()}, prompts: {self.prompts()})")

    def run_all(self, timeout: float = 300) -> None:
        """Run > Run All Cells, then wait until the run ends (all cells, or stopped at an error)."""
        deadline = time.monotonic() + timeout
        for _attempt in range(3):  # a click that lands before the kernel is wired up does nothing
            self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            self.page.locator(".lm-Menu-content .lm-Menu-itemLabel",
                              has_text=re.compile(r"^Run All Cells$")).click()
            started = time.monotonic()
            while time.monotonic() - started < 15:
                if any(p != "[ ]:" for p in self.prompts()):
                    break
                time.sleep(0.25)
            else:
                continue
            break
        while time.monotonic() < deadline:
            prompts = self.prompts()
            numbered = [p for p in prompts if re.fullmatch(r"\[\d+\]:", p)]
            if numbered and not any("*" in p for p in prompts) and self._status() == "idle":
                return
            time.sleep(0.5)
        raise TimeoutError(f"cells did not finish within {timeout:.0f} s (prompts: {self.prompts()})")

    def _status(self) -> str | None:
        return self.page.locator(".jp-Notebook-ExecutionIndicator").first.get_attribute("data-status")

    # -- results -----------------------------------------------------------------
    def save(self) -> None:
        """Save (Ctrl+S) and wait until the file on disk has every execution count the page shows."""
        self.page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
        self.page.keyboard.press("Control+s")
        deadline = time.monotonic() + 30
        want = sum(1 for p in self.prompts() if re.fullmatch(r"\[\d+\]:", p))
        while time.monotonic() < deadline:
            try:
                nb = json.loads((self.server.root / self.path).read_text())
                have = sum(1 for c in nb["cells"] if c.get("cell_type") == "code" and c.get("execution_count"))
                if have >= want:
                    return
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.3)
        raise TimeoutError("the notebook was not saved within 30 s")

    def notebook(self) -> dict:
        """The notebook as saved by JupyterLab (call after ``save``)."""
        return json.loads((self.server.root / self.path).read_text())

    def errors(self) -> list[str]:
        """Error outputs of the saved notebook, as 'cell N: Ename: evalue' (saves first)."""
        self.save()
        out = []
        for i, cell in enumerate(self.notebook()["cells"]):
            for o in cell.get("outputs", []):
                if o.get("output_type") == "error":
                    out.append(f"cell {i}: {o.get('ename')}: {o.get('evalue')}")
        return out

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


@pytest.fixture(scope="session")
def jupyter_lab(tmp_path_factory):
    require_browser()
    server = JupyterLabServer(tmp_path_factory.mktemp("jupyterlab"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _chromium(jupyter_lab):
    from playwright.sync_api import sync_playwright

    exe = require_browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def lab(_chromium, jupyter_lab, request):
    """A LabPage in a fresh browser context; saves test-artifacts/<test>-final.png at the end."""
    context = _chromium.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    lab_page = LabPage(page, jupyter_lab)
    try:
        yield lab_page
    finally:
        try:
            lab_page.screenshot(f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', request.node.name)}-final")
        except Exception:
            pass
        context.close()


def answer_text_question(question, text: str, expect: str, attempts: int = 3) -> None:
    """Type `text` into a quiz question's box, press Check, and wait until its feedback
    matches the regex `expect`.

    The box syncs its value to the kernel on blur (continuous_update=False), so the value
    is committed with Tab before the click. If a click is still lost (it can land while
    the front end is busy), it is retried: `attempts` tries of 20 s each, like a user
    who clicks again.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    box = question.locator(".quiz-input input")
    feedback = question.locator(".quiz-feedback").get_by_text(re.compile(expect))
    for _ in range(attempts):
        box.fill(text)
        box.press("Tab")
        question.locator("button.quiz-check").click()
        try:
            feedback.wait_for(timeout=20_000)
            return
        except PlaywrightTimeout:  # the click was lost: click again
            continue
    feedback.wait_for(timeout=5_000)  # raises with playwright's own message
