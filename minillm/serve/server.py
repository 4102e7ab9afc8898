"""Running the app under uvicorn, with a graceful drain on SIGTERM (and Ctrl-C).

On the first SIGTERM/SIGINT the server keeps listening but admits nothing new (503 +
Retry-After), lets in-flight requests finish for up to `drain_timeout_s`, aborts the rest,
and then shuts uvicorn down; `serve` returns 0. A second SIGINT exits at once.

    python -m minillm serve --port 8000 --max-num-seqs 16 --max-queue-len 64 [--device cuda]
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import uvicorn

from .app import create_app
from .config import ServeConfig

log = logging.getLogger("minillm.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signal starts a drain instead of closing the listener."""

    def __init__(self, config: uvicorn.Config, app):
        super().__init__(config)
        self.app = app
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and
        # the process would die of the signal instead of exiting 0.
        if self._drain_task is not None or self._loop is None:
            if sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        aengine = self.app.state.engine
        timeout = self.app.state.config.drain_timeout_s
        log.info("draining: %d request(s) in flight, up to %.1f s", aengine.num_in_flight(),
                 timeout)
        aborted = await aengine.drain(timeout)
        log.info("drained (%d aborted); shutting down", aborted)
        await asyncio.sleep(0.2)  # let the last responses flush
        self.should_exit = True


def serve(config: ServeConfig, model=None, tokenizer=None, log_level: str = "info") -> int:
    """Load the model (unless given), build the engine and the app, serve until drained."""
    from .. import LLMEngine, load_model
    if model is None:
        model, tokenizer = load_model(**config.load_options())
    engine = LLMEngine(model, tokenizer, **config.engine_options())
    app = create_app(engine, tokenizer, config)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                               timeout_graceful_shutdown=5, access_log=False)
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = DrainingServer(uv_config, app)
    log.info("serving %s on http://%s:%d (%s, %s; max_num_seqs=%d, max_queue_len=%d, "
             "num_blocks=%d)", config.model_name, config.host, config.port, model.device,
             str(model.dtype).removeprefix("torch."), config.max_num_seqs,
             config.max_queue_len, engine.config.num_blocks)
    server.run()
    return 0


class ThreadedServer:
    """An app served by uvicorn in a background thread on a free loopback port (tests, and
    a notebook that already holds the model). No signal handling: `stop()` shuts it down.
    By default it returns once the app is ready (its warm-up generation has finished), as
    `ServerProcess` does; `wait_ready=False` returns as soon as the port answers.

        with ThreadedServer(create_app(engine, tok, config)) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, app, port: int | None = None, log_level: str = "warning",
                 wait_ready: bool = True, ready_timeout_s: float = 120.0):
        from .process import free_port
        self.app, self.port = app, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level=log_level, access_log=False,
                                                    timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.02)
        aengine = app.state.engine
        deadline = time.monotonic() + ready_timeout_s
        while wait_ready and not aengine.warmed:
            if aengine.warmup_error is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on port {self.port} did not get ready within "
                                   f"{ready_timeout_s} s: {aengine.readiness_problem()}")
            time.sleep(0.02)

    def drain(self, timeout_s: float) -> int:
        """What SIGTERM does to `python -m minillm serve`: stop admitting, let in-flight
        requests run up to timeout_s, abort the rest (returns how many), then stop."""
        aengine = self.app.state.engine
        future = asyncio.run_coroutine_threadsafe(aengine.drain(timeout_s), aengine.loop)
        aborted = future.result(timeout_s + 30)
        self.stop()
        return aborted

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)

    def __enter__(self) -> "ThreadedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
