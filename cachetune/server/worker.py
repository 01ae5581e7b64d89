"""The one thread that owns the engine: queued jobs, then one engine step, over and over.

Every engine call of the server (register a document, add or abort a request, look up a chunk) is a
job run on this thread between steps, so the asyncio loop never waits on the engine's lock and requests
that arrive together are batched by the engine's scheduler. Tokens and ends travel back to the asyncio
side through `loop.call_soon_threadsafe`.

NOTE: `waiting` counts requests handed to the worker that have not produced their first token (job
queued, or waiting in the scheduler); the server refuses new requests past its max_queue from it, so
the queue never grows without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple

from cachetune.engine.engine import Engine, KVUsage
from cachetune.engine.request import Request
from cachetune.store.base import TierStats

log = logging.getLogger(__name__)


class Snapshot(NamedTuple):
    """Engine state taken by the worker after each step (read by /metrics without the engine lock)."""

    kv: KVUsage
    tiers: list[TierStats]
    chunks_encoded: int


class TokenStream:
    """The asyncio side of one request: (token, its TokenLogprob or None) as they come, then the end (None)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: asyncio.Queue[tuple | None] = asyncio.Queue()
        self.first_token_at: float | None = None
        self.request: Request | None = None

    def on_token(self, request: Request, token: int) -> None:  # worker thread
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        logprob = request.token_logprobs[-1] if request.sampling.logprobs is not None else None
        self.loop.call_soon_threadsafe(self.items.put_nowait, (token, logprob))

    def on_finish(self, request: Request) -> None:  # worker thread
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.loop.call_soon_threadsafe(self.items.put_nowait, None)


class EngineWorker:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachetune-engine", daemon=True)
        self._lock = threading.Lock()
        self.waiting = 0
        self.snapshot = self._snapshot()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the asyncio side -----------------------------------------------------------------------
    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the worker thread between steps; its result or its exception."""
        if not self.alive:
            raise RuntimeError("the engine worker is not running")
        future: Future = Future()
        self._jobs.put((fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def post(self, fn: Callable[[], Any]) -> None:
        """Queue fn() on the worker thread without waiting for it (a cancelled handler's abort)."""
        self._jobs.put((fn, Future()))
        self._wake.set()

    def count_waiting(self, delta: int) -> None:
        with self._lock:
            self.waiting += delta

    # ---- the worker thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopped.is_set():
            self._run_jobs()
            if engine.has_unfinished():
                try:
                    engine.step()
                except Exception:  # a step that breaks fails its requests, never the server
                    log.exception("engine step failed; ending the running requests")
                    self._fail_running()
                self.snapshot = self._snapshot()
            else:
                self._wake.wait(0.5)
                self._wake.clear()
        self._run_jobs()

    def _run_jobs(self) -> None:
        for _ in range(self._jobs.qsize()):  # the jobs queued now; later ones wait for the next step
            fn, future = self._jobs.get_nowait()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the awaiting handler
                future.set_exception(exc)
        if not self.engine.has_unfinished():
            self.snapshot = self._snapshot()

    def _fail_running(self) -> None:
        for request in self.engine.running_requests():
            request.error = RuntimeError("the engine step failed")
            self.engine.abort(request)

    def _snapshot(self) -> Snapshot:
        return Snapshot(self.engine.kv_usage(), self.engine.store.stats(), self.engine.chunks_encoded)
