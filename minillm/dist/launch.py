"""Starting ranks: `launch` for notebooks and tests, `init_from_env` under `torchrun`.

`launch(fn, world_size, *args)` spawns `world_size` fresh Python processes with
`torch.multiprocessing` (the "spawn" start method: nothing is inherited but the arguments),
joins them into one process group over 127.0.0.1 on a free port, calls
`fn(rank, world_size, *args, **kwargs)` in each and returns rank 0's return value.

Invariants:
- Only the loopback address is ever used (MASTER_ADDR, the TCP store and gloo's sockets).
- The backend follows the devices: NCCL when the course runs on CUDA
  (`minillm.devices.default_device()`) and CUDA shows a GPU for every rank, else gloo
  (the CPU path; one GPU with TP = 3 runs there rather than failing).
- Each rank runs `threads_per_rank` torch/OpenMP threads (default: the cores divided among
  the ranks, at least 1), so N ranks do not fight over the same cores.
- On any failure (a rank raises or dies, the timeout passes, the caller is interrupted)
  every child is terminated, then killed, and reaped before `launch` returns or raises:
  no process is left behind. If the launching process itself is killed, Linux kills the
  ranks (a parent-death signal). A rank's error comes back as a RuntimeError carrying its
  traceback text.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import io
import os
import pickle
import queue as queue_module
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from ..devices import cuda_requested

LOOPBACK = "127.0.0.1"
_PEER_GONE = "Connection closed by peer"  # gloo's error when another rank has exited
_GRACE_S = 2.0


def default_backend(world_size: int = 1) -> str:
    """NCCL when the course runs on CUDA (``minillm.devices.cuda_requested()``) and every
    rank can have a GPU of its own, else gloo (the CPU path), so that one GPU with TP = 3
    still runs, over gloo on the CPU, instead of failing; ``MINILLM_DEVICE=cpu`` keeps every
    rank on the CPU."""
    if cuda_requested() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def ranks_device(world_size: int) -> torch.device:
    """Where the ranks of a ``world_size``-process run compute: a GPU each under NCCL
    (rank 0's shown), else the CPU. What a lab compares a parallel run with."""
    if default_backend(world_size) == "nccl":
        return torch.device("cuda", 0)
    return torch.device("cpu")


def rank_device(rank: int) -> torch.device:
    """The device rank `rank` computes on: its own GPU under NCCL, else the CPU."""
    if tdist.is_initialized() and tdist.get_backend() == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    """Raise RuntimeError if `port` on 127.0.0.1 cannot be bound (something listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError as exc:
            raise RuntimeError(f"port {port} on {LOOPBACK} is already in use ({exc.strerror}); "
                               f"pass port=None to let launch pick a free one") from None


def _loopback_env(port: int, threads: int) -> None:
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port),
                      OMP_NUM_THREADS=str(threads))
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets stay on loopback
    torch.set_num_threads(threads)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the launching process dies, however it dies
    (torch's own parent-death signal is SIGINT, which a process started in the background
    of a shell ignores). Elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _rank_main(rank, fn, world_size, port, backend, threads, results, timeout_s, args, kwargs):
    """Body of each spawned process (module-level so that spawn can pickle it)."""
    if sys.platform.startswith("linux"):
        _die_with_parent()
    _loopback_env(port, threads)
    tdist.init_process_group(backend, init_method=f"tcp://{LOOPBACK}:{port}", rank=rank,
                             world_size=world_size, timeout=timedelta(seconds=timeout_s))
    # On an exception the group is left open: torch writes this rank's traceback, then the
    # process exits and only then do its peers see the connection close, so the rank that
    # failed first also wrote its error first (`_failure_report` relies on it).
    if backend == "nccl":
        torch.cuda.set_device(rank_device(rank))
    result = fn(rank, world_size, *args, **kwargs)
    if rank == 0:
        buffer = io.BytesIO()
        torch.save(result, buffer)  # bytes through the pipe: no shared-memory handles
        results.put(buffer.getvalue())
    tdist.destroy_process_group()


def default_threads_per_rank(world_size: int) -> int:
    """The torch/OpenMP threads each rank runs unless `launch` is told: the cores divided
    among the ranks (at least one)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def launch(fn, world_size: int, *args, backend: str | None = None, timeout_s: float = 300.0,
           port: int | None = None, threads_per_rank: int | None = None, **kwargs):
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return rank 0's
    result. `fn` must be a module-level function of an importable module (spawn pickles it
    by name: a function defined in a notebook cell or under a script's `__main__` guard-less
    body cannot be found by the children), and a script that calls `launch` needs the
    `if __name__ == "__main__":` guard.

    `port` (default: a free one) and `threads_per_rank` are launch's own keywords; every
    other keyword goes to `fn`. Raises RuntimeError with the failing rank's traceback, and
    TimeoutError after `timeout_s` seconds; in every case all children are gone afterwards.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    backend = backend or default_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"NCCL needs one GPU per rank: world_size={world_size}, "
                         f"{torch.cuda.device_count()} GPUs visible")
    if port is None:
        port = free_port()
    else:
        check_port_free(port)
    threads = threads_per_rank or default_threads_per_rank(world_size)
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    context = mp.start_processes(
        _rank_main, args=(fn, world_size, port, backend, threads, results, timeout_s, args,
                          kwargs),
        nprocs=world_size, join=False, start_method="spawn")
    payload = None
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            payload = _poll(results, payload)
            if context.join(timeout=0.05, grace_period=_GRACE_S):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"launch: the {world_size} ranks did not finish within "
                                   f"timeout_s={timeout_s}; all of them were stopped")
    except ProcessException as exc:
        raise RuntimeError(_failure_report(context, exc)) from None
    finally:
        _stop_and_reap(context.processes)
        results.close()
    payload = payload if payload is not None else _poll(results, None, wait_s=5.0)
    if payload is None:
        raise RuntimeError("launch: rank 0 finished without returning a result")
    return torch.load(io.BytesIO(payload), weights_only=False)


def _failure_report(context, exc: ProcessException) -> str:
    """The traceback of the rank that failed first (an error of its own, not gloo's "peer
    closed the connection", and written first), then one line per other rank."""
    raised = []
    for rank, path in enumerate(context.error_files):
        if os.access(path, os.R_OK) and os.path.getsize(path):
            with open(path, "rb") as f:
                text = pickle.load(f)
            raised.append((_PEER_GONE in text, os.path.getmtime(path), rank, text))
    if not raised:  # killed by a signal or os._exit: no traceback to show
        return f"launch: rank {exc.error_index} (pid {exc.error_pid}) failed: {exc}"
    raised.sort()  # a rank's own error before "a peer went away", then by time written
    *_, rank, text = raised[0]
    others = "".join(f"\nthen rank {r}: {t.strip().splitlines()[-1]}"
                     for *_, r, t in raised[1:])
    return f"launch: rank {rank} failed first:\n{text}{others}"


def _poll(results, payload, wait_s: float = 0.0):
    if payload is not None:
        return payload
    try:
        return results.get(timeout=wait_s) if wait_s else results.get_nowait()
    except queue_module.Empty:
        return None


def _stop_and_reap(processes) -> None:
    """SIGTERM every live child, SIGKILL those still alive after a grace period, join all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + _GRACE_S
    for p in processes:
        p.join(max(0.0, end - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def init_from_env(tp_size: int) -> tuple[int, int]:
    """Join the process group `torchrun` describes in the environment; returns (rank,
    world_size). Checks first, before any connection: torchrun must be running us, the world
    size must equal `tp_size`, and the master address must be the loopback."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise ValueError(f"--tp {tp_size} needs {tp_size} processes: run it as "
                         f"`torchrun --nproc-per-node {tp_size} -m minillm generate "
                         f"--tp {tp_size} ...`")
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world_size != tp_size:
        raise ValueError(f"torchrun started {world_size} processes but --tp is {tp_size}: "
                         f"they must match (torchrun --nproc-per-node {tp_size} ... --tp "
                         f"{tp_size})")
    addr = os.environ.get("MASTER_ADDR", LOOPBACK)
    if addr not in (LOOPBACK, "localhost"):
        raise ValueError(f"MASTER_ADDR is {addr!r}; minillm only runs on one machine over "
                         f"{LOOPBACK} (torchrun --master-addr {LOOPBACK})")
    _loopback_env(int(os.environ.get("MASTER_PORT", "29500")),
                  default_threads_per_rank(world_size))
    backend = default_backend(world_size)
    tdist.init_process_group(backend, rank=rank, world_size=world_size)
    if backend == "nccl":
        torch.cuda.set_device(rank_device(int(os.environ.get("LOCAL_RANK", rank))))
    return rank, world_size
