"""The connector's worker side: blends claimed spans into vLLM's paged cache, stores registered documents.

Runs in vLLM's worker process, once the worker extension has attached the model (`attach`). Before a
step's forward (`blend_all`), each BlendJob becomes a standalone-engine prefill over the request's whole
prompt: documents read from cachetune's tiers (pre-RoPE keys, rotated at their new positions), the
selected tokens and the text between documents computed through vLLM's own modules, the same selector
code choosing what to recompute. The final K/V of rows [start, end) are written at the request's slots
by the attention backend's own update; vLLM then computes the rest of the prompt over them.

Any failure (a document evicted or corrupt, no model attached, an error in the blend) marks the job's
blocks as failed: vLLM recomputes them (kv_load_failure_policy "recompute"), the request never fails,
and `counters` says how often it happened.

Under tensor parallelism every rank runs this on its own heads, in step (vllm.parallel): the ranks
agree on whether a job's documents are all there before any of them blends it, selections see every
rank's heads, and a document is gathered whole before it is stored.

After the forward (`save_all`), each SaveJob's rows are read back from the paged cache, their keys
rotated back to pre-RoPE, ranked, and stored: the same format and chunk id the standalone engine
writes, so either reads the other's documents.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from cachetune.chunks.encode import EncodedChunk, chunk_id
from cachetune.chunks.ranking import ranking_from_scores
from cachetune.chunks.rankers import ChunkView
from cachetune.chunks.rankings import ChunkRankings
from cachetune.config import parse_tiers
from cachetune.methods import MethodContext, PromptLayout, Segment, make_method
from cachetune.model.loader import default_cache_dir
from cachetune.runtime.loading import Pipeline
from cachetune.runtime.prefill import Prefill
from cachetune.runtime.prefix_cache import PrefixCache
from cachetune.store.base import ChunkStore, CorruptChunkError
from cachetune.store.blob import ModelShape
from cachetune.store.tiered import build_store
from cachetune.vllm.adapter import VllmAdapter
from cachetune.vllm.attention import kernel_error
from cachetune.vllm.metrics import tier_key
from cachetune.vllm.config import ConnectorSettings
from cachetune.vllm.paged import BlockLayout, round_trip_error, slots_of, write_rows
from cachetune.vllm.scheduler import BlendJob, SaveJob, StepJobs

log = logging.getLogger(__name__)


class DocumentUnavailable(RuntimeError):
    """A document the scheduler claimed is not in any tier intact (evicted, corrupt, never stored)."""


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, fingerprint: Callable[[], str], block_size: int):
        self.settings = settings
        self._fingerprint = fingerprint
        self.block_size = block_size
        self.adapter: VllmAdapter | None = None
        self.store: ChunkStore | None = None
        self.context: MethodContext | None = None
        self.fingerprint: str | None = None
        self._layouts: list[BlockLayout] | None = None
        self._failed_blocks: set[int] = set()
        self.counters = {"blended_requests": 0, "blended_tokens": 0, "computed_tokens": 0,
                         "recomputed_document_tokens": 0, "reused_tokens": 0, "recomputed_by_vllm": 0,
                         "missing_documents": 0, "saved_documents": 0, "save_failures": 0,
                         "blend_seconds": 0.0, "longest_blend_seconds": 0.0}

    # ---- set-up -------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module, store: ChunkStore | None = None) -> None:
        """Serve with `model` (vLLM's, in this worker) from `store` (default: the settings' tiers)."""
        adapter = VllmAdapter(model)
        # Rank 0 alone computes it (that may load the model once more through transformers).
        fingerprint = adapter.heads.from_first(self._fingerprint() if adapter.heads.rank == 0 else None)
        if store is None:  # documents are stored whole: every KV head, whichever rank stores them
            shape = ModelShape(adapter.num_layers, adapter.heads.total_kv_heads, adapter.head_dim)
            store = build_store(parse_tiers(self.settings.tiers), fingerprint, shape, adapter.device,
                                default_cache_dir() / "chunks")
        engine = self.settings.engine

        def no_probes():
            raise ValueError("rankers that run the model are not available inside vLLM; use a positional "
                             "or key-based ranking (first, lf, ...)")

        rankings = ChunkRankings(adapter, engine.ranking, engine.alpha, no_probes, engine.tracked_chunks, store)
        self.context = MethodContext(adapter, rankings, PrefixCache(max_blocks=1), Pipeline(overlap=engine.prefetch),
                                     store)
        self.adapter, self.store, self.fingerprint = adapter, store, fingerprint

    @property
    def attached(self) -> bool:
        return self.adapter is not None

    def layouts(self) -> list[BlockLayout]:
        if self._layouts is None:
            self._layouts = [BlockLayout.probe(layer.self_attn.attn, self.adapter.num_kv_heads, self.adapter.head_dim)
                             for layer in self.adapter.layers]
        return self._layouts

    def layout_error(self) -> float:
        """The round-trip error of every layer's learned cache layout (paged.round_trip_error): 0.0
        when documents read back from vLLM's cache are exactly what its backend wrote."""
        adapter = self.adapter
        return max(round_trip_error(layer.self_attn.attn, packing, adapter.num_kv_heads, adapter.head_dim)
                   for layer, packing in zip(adapter.layers, self.layouts()))

    def attention_error(self) -> float | None:
        """The largest difference between the blend's attention on vLLM's kernel and the runtime's
        (vllm.attention.kernel_error); None when no layer runs on vLLM's kernel."""
        adapter = self.adapter
        return kernel_error(adapter.attention_kernel, adapter.num_heads, adapter.num_kv_heads, adapter.head_dim,
                            adapter.dtype, [info.scale for info in adapter.layer_info])

    # ---- before the forward -------------------------------------------------------------------
    def blend_all(self, jobs: StepJobs) -> None:
        for job in jobs.blends:
            started = time.perf_counter()
            try:
                result = self.blend(job)
            except DocumentUnavailable as exc:
                self.counters["missing_documents"] += 1
                self._fail(job, exc)
            except Exception as exc:  # any error ends in vLLM's own recompute, never a failed request
                log.exception("blend of request %s failed", job.request_id)
                self._fail(job, exc)
            else:
                self.counters["blended_requests"] += 1
                self.counters["blended_tokens"] += job.end - job.start
                self.counters["computed_tokens"] += result.computed_tokens
                self.counters["recomputed_document_tokens"] += result.recomputed_chunk_tokens
                self.counters["reused_tokens"] += result.reused_rows
            took = time.perf_counter() - started
            self.counters["blend_seconds"] += took
            self.counters["longest_blend_seconds"] = max(self.counters["longest_blend_seconds"], took)

    def _fail(self, job: BlendJob, reason: BaseException) -> None:
        log.warning("request %s: rows [%d, %d) go back to vLLM to compute: %s", job.request_id, job.start,
                    job.end, reason)
        self.counters["recomputed_by_vllm"] += 1
        first, last = job.start // self.block_size, (job.end - 1) // self.block_size
        self._failed_blocks.update(job.block_ids[first:last + 1])

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def totals(self) -> dict[str, float]:
        """Every cumulative counter of this side, the tiers' hits, bytes read and errors included
        (metrics.tier_key names them)."""
        totals = {name: value for name, value in self.counters.items() if name != "longest_blend_seconds"}
        for tier in self.store.stats() if self.store is not None else ():
            totals.update({tier_key("hits", tier.tier): tier.hits, tier_key("bytes_read", tier.tier): tier.bytes_read,
                           tier_key("errors", tier.tier): tier.errors})
        return totals

    @torch.no_grad()
    def blend(self, job: BlendJob) -> Prefill:
        """Fill the job's rows; the prefill that computed them (what it computed, what it reused)."""
        if self.adapter is None:
            raise RuntimeError("no model attached (call cachetune.vllm.attach(llm) after start-up)")
        layout = self.layout(job)
        method = make_method(job.method, self.settings.engine, ratio=job.ratio)
        heads = self.adapter.heads
        for _, segment in layout.chunk_segments:  # offline scores from every head, as one process has them
            method.prepare(self.context, segment.chunk)
        layout = PromptLayout([Segment(s.token_ids, heads.shard(s.chunk) if s.cached else None)
                               for s in layout.segments])
        result = method.prefill(self.context, layout, layout.total)
        if result.attention is not None or result.prompt_rows != layout.total:
            # vLLM decodes with its own causal attention over one row per position.
            raise ValueError(f"method {job.method!r} needs its own decode attention or rows; it cannot serve in vLLM")
        cache = result.cache
        slots = slots_of(job.block_ids, self.block_size, job.start, job.end)
        for index, layer in enumerate(self.adapter.layers):
            write_rows(layer.self_attn.attn, cache.keys[index, job.start:job.end],
                       cache.values[index, job.start:job.end], slots)
        return result

    def layout(self, job: BlendJob) -> PromptLayout:
        """The request's whole prompt: its documents as stored chunks, everything else as text.
        Raises DocumentUnavailable on every rank when one rank lacks one."""
        prompt = torch.tensor(job.prompt, dtype=torch.int64)
        segments, at, problem = [], 0, None
        for start, cid in job.documents:
            try:
                stored = self.store.get(cid)
            except CorruptChunkError as exc:
                problem = f"document {cid} is corrupt: {exc}"
                break
            if stored is None:
                problem = f"document {cid} is in no tier"
                break
            n = stored.num_tokens
            if not torch.equal(stored.token_ids.cpu(), prompt[start:start + n]):
                problem = f"document {cid}'s tokens are not at prompt position {start}"
                break
            if start > at:
                segments.append(Segment(prompt[at:start]))
            segments.append(Segment(prompt[start:start + n], stored))
            at = start + n
        if not self.adapter.heads.all(problem is None):
            raise DocumentUnavailable(problem or "a document is unavailable on another tensor-parallel rank")
        segments.append(Segment(prompt[at:]))
        return PromptLayout(segments)

    # ---- after the forward --------------------------------------------------------------------
    @torch.no_grad()
    def save_all(self, jobs: StepJobs) -> None:
        for job in jobs.saves:
            try:
                self.save(job)
            except Exception:  # a document not stored is only a later miss
                log.exception("storing document %s failed", job.chunk_id)
                self.counters["save_failures"] += 1
            else:
                self.counters["saved_documents"] += 1

    def save(self, job: SaveJob) -> None:
        if self.adapter is None:
            raise RuntimeError("no model attached")
        adapter, n = self.adapter, len(job.tokens)
        slots = slots_of(job.block_ids, self.block_size, 0, n)
        shape = (adapter.num_layers, n, adapter.heads.total_kv_heads, adapter.head_dim)
        keys = torch.empty(shape, dtype=adapter.dtype)
        values = torch.empty(shape, dtype=adapter.dtype)
        cos, sin = adapter.rope_tables(torch.arange(n), torch.float32)[None]
        for index, (layer, packing) in enumerate(zip(adapter.layers, self.layouts())):
            k, v = packing.read(layer.self_attn.attn.kv_cache, slots)  # [n, this rank's KV heads, D]
            keys[index] = adapter.heads.gather(adapter.rotate(k.float(), cos, -sin).to(adapter.dtype)).cpu()  # pre-RoPE
            values[index] = adapter.heads.gather(v).cpu()
        ids = torch.tensor(job.tokens, dtype=torch.int64)
        cid = chunk_id(self.fingerprint, ids)
        if cid != job.chunk_id:
            raise RuntimeError(f"scheduler and worker disagree on the model fingerprint ({job.chunk_id} != {cid})")
        ranker = self.context.rankings.ranker()
        scores = ranker.scores(ChunkView(ids, keys, values, None))
        self.store.put(EncodedChunk(cid, ids, keys, values, ranking_from_scores(scores), scores, ranker.name))
