"""Real English text for calibration and evaluation: the Lee news corpus.

`lee_corpus()` returns the articles of `lee_background.cor` (about 300 news articles, one per
line, ~360 KB), which the gensim wheel on PyPI ships as test data. Nothing comes from a
model hub: the first call runs `pip download --no-deps gensim==4.4.0` into a temporary
folder, takes that one file out of the wheel (a zip) and caches it under
~/.cache/minillm (or $MINILLM_CACHE_DIR); gensim itself is never installed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GENSIM_WHEEL = "gensim==4.4.0"
MEMBER = "gensim/test/test_data/lee_background.cor"


def cache_dir() -> Path:
    return Path(os.environ.get("MINILLM_CACHE_DIR", Path.home() / ".cache" / "minillm"))


def lee_corpus_path() -> Path:
    """The cached corpus file, fetched from the gensim wheel on first use."""
    path = cache_dir() / "lee_background.cor"
    if path.exists():
        return path
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", GENSIM_WHEEL,
               "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("gensim-*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"could not fetch the Lee corpus: `{' '.join(cmd)}` failed "
                               f"({done.stderr.strip()[-300:]}); it needs PyPI")
        with zipfile.ZipFile(wheels[0]) as wheel:
            data = wheel.read(MEMBER)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(".part")
    tmp_path.write_bytes(data)
    tmp_path.replace(path)  # atomic: a half-written file is never taken for the corpus
    return path


def lee_corpus() -> list[str]:
    """The corpus's articles, one string each."""
    text = lee_corpus_path().read_text(encoding="utf-8", errors="replace")
    return [line.strip() for line in text.splitlines() if line.strip()]
