"""First come, first served admission under a KV budget, and the set of running requests.

NOTE: a request reserves all the rows it can ever need (prompt + max_new_tokens) when it is
admitted, so a running request never runs out of KV and nothing is ever preempted or half-served;
the price is that rows a request will not use (it stops early) are held until it ends.
"""

from __future__ import annotations

from collections import deque

from cachetune.engine.request import Request, RequestStatus
from cachetune.errors import RequestError


class KVBudget:
    """Rows of KV (one row = one token's keys and values in every layer) running requests share."""

    def __init__(self, total_rows: int):
        if total_rows < 1:
            raise ValueError(f"a KV budget needs at least one row, got {total_rows}")
        self.total = total_rows
        self.used = 0

    @property
    def free(self) -> int:
        return self.total - self.used

    def reserve(self, rows: int) -> None:
        if rows > self.free:
            raise RuntimeError(f"reserving {rows} rows with {self.free} free")  # the scheduler checks first
        self.used += rows

    def release(self, rows: int) -> None:
        self.used -= rows


class Scheduler:
    """Waiting requests in arrival order and the running ones; `schedule` picks who starts now."""

    def __init__(self, budget: KVBudget, max_running: int, prefill_tokens_per_step: int):
        self.budget = budget
        self.max_running = max_running
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        if request.rows > self.budget.total:
            raise RequestError(
                f"request needs {request.rows} KV rows ({request.rows - request.sampling.max_new_tokens} for "
                f"its prompt + {request.sampling.max_new_tokens} new tokens) but the whole KV budget is {self.budget.total} rows; "
                "raise kv_budget_bytes or shorten the request"
            )
        self.waiting.append(request)

    def schedule(self) -> list[Request]:
        """Admit waiting requests in order while their rows fit, up to max_running and this step's
        prefill tokens (the first admitted request always counts as fitting the token limit).
        Strictly in order: a large request at the head waits for room rather than being overtaken."""
        admitted: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) < self.max_running:
            head = self.waiting[0]
            if head.rows > self.budget.free:
                break
            if admitted and tokens + head.prompt_tokens > self.prefill_tokens_per_step:
                break
            self.waiting.popleft()
            self.budget.reserve(head.rows)
            head.status = RequestStatus.RUNNING
            self.running.append(head)
            admitted.append(head)
            tokens += head.prompt_tokens
        return admitted

    def remove(self, request: Request) -> None:
        """Forget a request that has ended; its rows go back to the budget at once."""
        if request in self.running:
            self.running.remove(request)
            self.budget.release(request.rows)
        elif request in self.waiting:
            self.waiting.remove(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
