"""`CachetuneConnector`: vLLM's KV connector interface over the scheduler and worker sides.

vLLM builds one instance per role from `kv_transfer_config` (`cachetune.vllm.connector_config()`):
the scheduler's delegates to `SchedulerSide`, the worker's to `WorkerSide`. Loading is synchronous:
the blend runs inside the step, before the forward, so running decodes wait for it. The stall is the
time of that step's blends; `max_num_batched_tokens` does not bound it, `blends_per_step` does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                 KVConnectorRole)

from cachetune.vllm.config import ConnectorSettings, check_parallelism, model_fingerprint_of
from cachetune.vllm.metrics import CachetunePromMetrics, CachetuneStats, Increments
from cachetune.vllm.scheduler import BlendJob, SaveJob, SchedulerSide, SharedTokens, StepJobs, model_shape
from cachetune.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class CachetuneMetadata(KVConnectorMetadata):
    blends: list[BlendJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)

    @property
    def jobs(self) -> StepJobs:
        return StepJobs(self.blends, self.saves)


class CachetuneConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError('the cachetune connector needs kv_load_failure_policy="recompute", so a document that '
                             "cannot be loaded is computed by vLLM instead of failing the request "
                             "(cachetune.vllm.connector_config() sets it)")
        parallel = vllm_config.parallel_config
        check_parallelism(parallel.pipeline_parallel_size)
        self.settings = ConnectorSettings.from_extra(transfer.kv_connector_extra_config)
        self._fingerprint = self.settings.fingerprint
        block_size = vllm_config.cache_config.block_size
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._increments = Increments()
        if role == KVConnectorRole.SCHEDULER:
            shape = model_shape(vllm_config.model_config.hf_config)
            shared = SharedTokens(self.settings.tiers, self.fingerprint, shape)
            self.scheduler = SchedulerSide(self.settings, self.fingerprint, shared)
        else:
            self.worker = WorkerSide(self.settings, self.fingerprint, block_size)

    def fingerprint(self) -> str:
        """The model's cachetune fingerprint: configured, or computed once from its files (which loads
        the model through transformers once; the result is kept on disk)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint_of(self._vllm_config.model_config.model)
        return self._fingerprint

    # ---- scheduler side -------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self.scheduler.registering(request.request_id, list(request.prompt_token_ids or []),
                                   request.kv_transfer_params)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        claimed = self.scheduler.matched(request.request_id, list(request.prompt_token_ids or []),
                                         request.kv_transfer_params, request.cache_salt, num_computed_tokens)
        return claimed, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.allocated(request.request_id, list(request.prompt_token_ids or []),
                                 list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        new = [(r.req_id, r.block_ids[0], r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached_output = scheduler_output.scheduled_cached_reqs
        cached = [(rid, None if blocks is None else blocks[0], computed) for rid, blocks, computed in
                  zip(cached_output.req_ids, cached_output.new_block_ids, cached_output.num_computed_tokens)]
        jobs = self.scheduler.step_jobs(new, cached, scheduler_output.num_scheduled_tokens)
        return CachetuneMetadata(jobs.blends, jobs.saves)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self.scheduler.finished(request.request_id)

    # ---- worker side ----------------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, CachetuneMetadata) and meta.blends:
            self.worker.blend_all(meta.jobs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # every claimed row is written before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return None  # documents are read back once all layers are written (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, CachetuneMetadata) and meta.saves:
            self.worker.save_all(meta.jobs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks() if self.worker is not None else set()

    # ---- metrics (either side) ------------------------------------------------------------------
    def get_kv_connector_stats(self) -> CachetuneStats | None:
        """What this side's counters gained since vLLM last asked (it asks after every step)."""
        if self.scheduler is not None:
            return self._increments(self.scheduler.counters)
        if self.worker is not None and self._vllm_config.parallel_config.rank == 0:  # one rank speaks
            return self._increments(self.worker.totals())
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> CachetuneStats:
        return CachetuneStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> CachetunePromMetrics:
        return CachetunePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
