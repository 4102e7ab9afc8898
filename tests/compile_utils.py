"""Building Triton kernels for a CUDA GPU on a machine without one.

The interpreter is chosen when a kernel is defined (`minillm.kernels.interpreter`), so a test
that compiles kernels ahead of time for a GPU target (sm_90, sm_80) runs its code in a fresh
process with `TRITON_INTERPRET=0` and `torch.cuda.is_available` patched to say yes. The
code prints "compiled" when it got to its end.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def assert_compiles(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` (dedented) in a fresh Python without Triton's interpreter; it must exit 0
    and print "compiled". Returns the finished process (its stdout for further checks)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = "0"
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
    return res
