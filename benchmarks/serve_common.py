"""What the serving benchmarks share: the machine description and a server to measure."""
from __future__ import annotations

import os
import platform
import subprocess
import time


def machine() -> dict:
    try:
        model = next(line.split(":", 1)[1].strip() for line in
                     subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                     if line.startswith("Model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown"
    return {"cpu": model, "cores": os.cpu_count(), "date_utc": time.strftime(
        "%Y-%m-%d %H:%M", time.gmtime()), "load_average_at_start": os.getloadavg()}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
