"""The worker extension that hands vLLM's model to the connector (vLLM gives a connector none).

Loaded by vLLM with `worker_extension_cls` (`cachetune.vllm.llm_options()` sets it); its methods run in
every worker through `collective_rpc`. `cachetune.vllm.attach(llm)` calls `cachetune_attach` once
after start-up."""

from __future__ import annotations

from typing import Any


class CachetuneWorkerExtension:
    """Mixed into vLLM's worker class: `self.model_runner` is the worker's model runner."""

    def cachetune_attach(self) -> bool:
        """Give this worker's connector the model it serves; True when it serves with it."""
        self._cachetune_worker().attach(self.model_runner.get_model())
        return True

    def cachetune_counters(self) -> dict[str, Any]:
        """What the connector did in this worker: blends, tokens, recomputes by vLLM, saves."""
        return dict(self._cachetune_worker().counters)

    def cachetune_layout_error(self) -> float:
        """The round-trip error of reading vLLM's paged cache back (0.0: exact)."""
        return self._cachetune_worker().layout_error()

    def cachetune_attention_error(self) -> float | None:
        """How far the blend's attention on vLLM's kernel is from the runtime's (None: not on the kernel)."""
        return self._cachetune_worker().attention_error()

    def _cachetune_worker(self):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        worker = getattr(connector, "worker", None)
        if worker is None:
            raise RuntimeError("vLLM was not started with the cachetune connector (cachetune.vllm.connector_config())")
        return worker
