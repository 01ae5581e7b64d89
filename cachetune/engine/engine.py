"""The Engine facade: cache chunks once, then serve requests assembled from them in one step loop.

    engine = Engine.from_pretrained()                       # bundled SmolLM2-135M-Instruct
    ids = [engine.cache_document(text) for text in docs]    # text + separator, encoded once
    out = engine.generate(chunks=ids, question="...", method="cachetune", ratio=0.15)

    req = engine.add_request(ids, "...", on_token=print)    # many requests: add, then step
    while engine.has_unfinished():
        engine.step()                                       # admit + prefill, then one batched decode

The parts live in their own modules: chunk_cache (chunks by content address: encode, find, re-encode),
scheduler (admission under the KV budget), request (what a request carries), calibration (the
measured ratios "auto" reads) and prompt (the chat template).

One loop owns the model: `step` (and `generate`, which steps until its request ends) may be called
from any thread, but steps run one at a time under the engine's lock; `add_request`, `abort` and
`cache_chunk` take the same lock, so they wait for a running step to end.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from dataclasses import replace
from functools import partial
from typing import NamedTuple, Sequence

import torch

from cachetune.c2kv.bank import ExtractorBank
from cachetune.chunks.rankers import get_ranker
from cachetune.chunks.rankings import ChunkRankings
from cachetune.config import EngineConfig, length_floor, parse_length_floors, parse_tiers
from cachetune.engine.calibration import (AUTO, FILE_NAME, PRICE, RATIO, CalibrationFile, CalibrationKey,
                                         device_identity)
from cachetune.engine.chunk_cache import ChunkCache, ranking_context
from cachetune.engine.prompt import DEFAULT_SYSTEM, PromptTemplate
from cachetune.engine.request import (FinishCallback, GenerationResult, Request, RequestStatus, StopRule,
                                      TokenCallback)
from cachetune.engine.scheduler import KVBudget, Scheduler
from cachetune.engine.selfcheck import ReuseRefusedError, run_self_check
from cachetune.errors import RequestError
from cachetune.methods import Method, MethodContext, Prefill, PromptLayout, Segment, make_method
from cachetune.methods.full_recompute import FULL_RECOMPUTE
from cachetune.runtime.prefix_cache import PrefixCache
from cachetune.model.adapter import ModelAdapter
from cachetune.model.loader import LoadedModel, default_cache_dir, load_model, model_fingerprint, weights_identity
from cachetune.runtime.decode import SamplingConfig, TokenLogprob, sample, token_logprobs
from cachetune.runtime.forward import PromptHidden, decode_step, keeping_prompt_hidden
from cachetune.runtime.kv_cache import kv_bytes_per_row
from cachetune.runtime.loading import Pipeline
from cachetune.store.base import ChunkStore, CorruptChunkError, StoredChunk
from cachetune.store.blob import ModelShape
from cachetune.store.tiered import build_store

log = logging.getLogger(__name__)

PROMPT_LOGITS_BLOCK = 256  # prompt positions turned into logits at once (echo): bounds a [block, vocab] buffer


class StepResult(NamedTuple):
    finished: list[Request]  # requests that ended in this step
    prefilled: int           # requests admitted and prefilled
    decoded: int             # tokens produced by this step's decode
    prefill_s: float
    decode_s: float


class KVUsage(NamedTuple):
    total_rows: int
    used_rows: int
    bytes_per_row: int
    waiting: int
    running: int


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, store: ChunkStore | None = None):
        self.config = config = config or EngineConfig()
        get_ranker(config.ranking, config.alpha)  # unknown names fail before any work
        make_method(config.method, config)
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model = loaded.model.to(config.torch_device)
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name
        self.adapter = ModelAdapter(self.model)
        self.fingerprint = model_fingerprint(self.model)
        self.template = PromptTemplate(self.tokenizer)
        self.vocab_size = self.adapter.backbone.embed_tokens.num_embeddings
        self.max_context = getattr(self.model.config, "max_position_embeddings", None)
        self.store = store or self._default_store()
        self.calibration = CalibrationFile(config.calibration or default_cache_dir() / FILE_NAME)
        self._lock = threading.RLock()
        probes = partial(ranking_context, self.adapter, self.template, getattr(self.tokenizer, "bos_token_id", None))
        self.rankings = ChunkRankings(self.adapter, config.ranking, config.alpha, probes, config.tracked_chunks,
                                      self.store)
        self.chunk_cache = ChunkCache(self.adapter, self.fingerprint, self.store, self.rankings, self.vocab_size,
                                      self.max_context, self._lock, config.tracked_chunks, config.fallback_bytes)
        self.prefix_cache = PrefixCache(max_blocks=config.prefix_blocks)
        self.extractors = ExtractorBank(self.adapter, weights_identity(self.model), self.fingerprint, self.eos_id())
        self.context = MethodContext(self.adapter, self.rankings, self.prefix_cache, Pipeline(overlap=config.prefetch),
                                     self.store, self.extractors, self.price_scale)
        self.kv_bytes_per_row = kv_bytes_per_row(self.adapter.num_layers, self.adapter.num_kv_heads,
                                                 self.adapter.head_dim, self.adapter.dtype)
        budget = KVBudget(max(1, config.kv_budget_bytes // self.kv_bytes_per_row))
        self.scheduler = Scheduler(budget, config.max_running, config.prefill_tokens_per_step)
        self._ids = itertools.count()
        self._stop_ids = self.stop_ids()
        self.reuse_error: str | None = None
        self.self_check_error: float | None = None
        if config.self_check:
            try:
                self.self_check_error = run_self_check(self.adapter, self.fingerprint, self.vocab_size)
            except ReuseRefusedError as exc:
                self.reuse_error = str(exc)
                log.error("%s", exc)

    @classmethod
    def from_pretrained(cls, spec: str | None = None, config: EngineConfig | None = None, **overrides) -> "Engine":
        """Load a preset, HF directory or .gguf file. Keyword overrides are EngineConfig fields."""
        config = replace(config or EngineConfig(), **({"model": spec} if spec else {}), **overrides)
        config.torch_device  # noqa: B018 - a CUDA device on a CPU-only machine fails here, before loading
        return cls(load_model(config.model, dtype=config.torch_dtype), config)

    def _default_store(self) -> ChunkStore:
        shape = ModelShape(self.adapter.num_layers, self.adapter.num_kv_heads, self.adapter.head_dim)
        return build_store(parse_tiers(self.config.tiers), self.fingerprint, shape, self.adapter.device,
                           default_cache_dir() / "chunks")

    # ---- chunks (ChunkCache does the work; these are the engine's public calls) ------------------
    def tokenize(self, text: str) -> torch.Tensor:
        """Token ids of user text; special-token strings in it stay text."""
        return self.template.encode(text)

    def cache_chunk(self, text: str) -> str:
        """Encode `text` on its own once, rank its tokens and store it; returns its content-address id."""
        if not isinstance(text, str):
            raise TypeError(f"a chunk is text (str), got {type(text).__name__}")
        return self.chunk_cache.cache_tokens(self.tokenize(text))

    def cache_document(self, text: str) -> str:
        """Cache a document as prompts lay it out (its text and the document separator,
        PromptTemplate.document); returns its chunk id."""
        return self.chunk_cache.cache_tokens(self.template.document(text))

    def cache_tokens(self, token_ids: torch.Tensor | Sequence[int]) -> str:
        """Like cache_chunk for text already tokenized (the ids are used exactly as given)."""
        return self.chunk_cache.cache_tokens(token_ids)

    def chunk(self, cid: str) -> StoredChunk:
        """The stored chunk; a missing or corrupt one is re-encoded if this engine knows its tokens
        (KeyError otherwise). See ChunkCache for the fallback memory that outlives a tier outage."""
        return self.chunk_cache.chunk(cid)

    def find_chunk(self, cid: str) -> StoredChunk | None:
        """The stored chunk, or None when no tier (nor the fallback memory) holds it intact (nothing is
        encoded)."""
        return self.chunk_cache.find(cid)

    def remove_chunk(self, cid: str) -> bool:
        """Forget a chunk in every tier (shared ones too); False when none held it. Requests already
        holding it keep their handle."""
        return self.chunk_cache.remove(cid)

    @property
    def chunks_encoded(self) -> int:
        """Chunks this engine ran through the model (a chunk found in the store is not)."""
        return self.chunk_cache.encoded

    # ---- prefix cache -------------------------------------------------------------------------
    def cache_prefix(self, token_ids: torch.Tensor) -> int:
        """Keep the KV of a plain prefill of `token_ids` [N] in the prefix cache, as serving them as a
        prompt with full recompute would; returns the tokens it now covers (whole blocks only). Nothing
        is computed when those blocks are cached already."""
        cache = self.prefix_cache
        full_blocks = (token_ids.numel() // cache.block_size) * cache.block_size
        with self._lock:
            # match() never counts the last token, so probe with one more: are all full blocks cached?
            if cache.match(torch.cat([token_ids, token_ids[:1]])) >= full_blocks:
                return full_blocks
            cache.insert(token_ids, self.prefill(PromptLayout([Segment(token_ids)]), FULL_RECOMPUTE).cache)
        return full_blocks

    # ---- prompts and methods ------------------------------------------------------------------
    def build_prompt(self, chunks: Sequence[str], question: str, system: str | None = None) -> PromptLayout:
        """Template start + system prompt, the cached chunks in the given order, then the question."""
        if isinstance(chunks, str):
            raise TypeError("chunks is a list of chunk ids, not one string")
        before, after = self.template.segments(DEFAULT_SYSTEM if system is None else system, question)
        return self.prompt_from(before, chunks, after)

    def prompt_from(self, before: torch.Tensor, chunks: Sequence[str | StoredChunk], after: torch.Tensor
                    ) -> PromptLayout:
        """A prompt of uncached token ids `before`, the cached `chunks` (ids, or chunks already looked
        up with chunk()) in order, and `after`."""
        stored = [c if isinstance(c, StoredChunk) else self.chunk(c) for c in chunks]
        head = [Segment(before)] if before.numel() else []  # a bare completion prompt has nothing before
        return PromptLayout([*head, *(Segment(c.token_ids, c) for c in stored), Segment(after)])

    def method(self, spec: str | Method | None = None, ratio: float | str | None = None,
               ranking: str | None = None, prompt: PromptLayout | None = None) -> Method:
        """A method by name ("cachetune", "cachetune:probe", ...; None: the configured default) with
        settings from this engine's config and the given overrides, or a Method instance as it is.
        ratio "auto" is the calibrated ratio for where `prompt`'s chunks are read from (auto_ratio)."""
        if isinstance(spec, Method):
            return spec
        if ratio == AUTO:
            if prompt is None:
                raise ValueError('ratio "auto" depends on where the chunks are read from: pass the prompt')
            ratio = self.auto_ratio(prompt)
        elif isinstance(ratio, str):
            raise ValueError(f'ratio must be a number in [0, 1] or "auto", got {ratio!r}')
        return make_method(self.config.method if spec is None else spec, self.config, ratio=ratio, ranking=ranking)

    # ---- calibrated ratios (cachetune calibrate) ------------------------------------------------
    def calibration_key(self, tier: str, kind: str = RATIO) -> CalibrationKey:
        """The calibration key of this engine's model, device and dtype for a tier label (a ratio) or
        for deep focus's price (kind PRICE, tier "")."""
        return CalibrationKey(self.fingerprint, device_identity(self.adapter.device), self.config.dtype, tier, kind)

    def price_scale(self) -> float | None:
        """Deep focus's measured over predicted price on this machine (`cachetune calibrate-price`), or
        None where it has none for this model, device and dtype."""
        return self.calibration.value(self.calibration_key("", PRICE))

    def tier_labels(self) -> list[str]:
        """Labels of this engine's tiers, fastest first (what a calibration is keyed by)."""
        return [t.label or t.kind for t in getattr(self.store, "tiers", [self.store])]

    def calibrated_ratios(self) -> dict[str, float]:
        """Tier label -> its calibrated ratio, for the tiers of this engine that have one (valid for
        this model, device and dtype)."""
        found = {tier: self.calibration.ratio(self.calibration_key(tier)) for tier in self.tier_labels()}
        return {tier: r for tier, r in found.items() if r is not None}

    # The ratio policy: every caller (the server, add_request, method) resolves "auto" through these two.
    def request_ratio(self, ratio: float | str | None, auto_by_default: bool = True) -> float | str | None:
        """The ratio a request runs at: `ratio` when it names one; else "auto" when `auto_by_default`
        (a server's config.auto_ratio) and a tier of this engine is calibrated for this machine; else
        None (the method's configured ratio)."""
        if ratio is None and auto_by_default and self.calibrated_ratios():
            return AUTO
        return ratio

    def auto_ratio(self, prompt: PromptLayout) -> float:
        """The ratio "auto" means for `prompt`: the largest calibrated ratio among the tiers its chunks
        were read from (the slowest read sets the pace), a tier without a calibration counting as
        config.min_ratio (the quality floor), and never below the floor for its chunks' mean length
        (config.length_floors); min_ratio for a prompt without chunks."""
        tiers = {seg.chunk.tier for _, seg in prompt.chunk_segments}
        ratios = [self.calibration.ratio(self.calibration_key(t)) if t else None for t in tiers]
        floor = length_floor(parse_length_floors(self.config.length_floors),
                             [seg.chunk.num_tokens for _, seg in prompt.chunk_segments])
        return max([self.config.min_ratio, *(r for r in (*ratios, floor) if r is not None)])

    def unavailable(self, method: Method) -> str | None:
        """Why `method` cannot serve on this engine (e.g. trained weights it needs are missing), or None."""
        return method.unavailable(self.context)

    def prepare(self, prompt: PromptLayout, method: Method) -> None:
        """The method's untimed offline work for every chunk of `prompt` (e.g. a non-default ranking)."""
        with self._lock:
            for _, seg in prompt.chunk_segments:
                method.prepare(self.context, seg.chunk)

    def _check_servable(self, prompt: PromptLayout, method: Method, new_tokens: int) -> None:
        if method.reuses_kv and self.reuse_error is not None:
            raise ReuseRefusedError(self.reuse_error)
        # Positions the prompt takes: its tokens, or more when a method adds rows (KVLink's links).
        positions = max(prompt.total, method.prompt_rows(prompt))
        if self.max_context is not None and positions + new_tokens > self.max_context:
            raise RequestError(
                f"prompt of {positions} positions plus {new_tokens} new tokens exceeds the model's context "
                f"window of {self.max_context} positions"
            )

    @torch.no_grad()
    def prefill(self, prompt: PromptLayout, method: str | Method | None = None, ratio: float | str | None = None,
                ranking: str | None = None, capacity: int | None = None) -> Prefill:
        """Fill a KV cache for `prompt` alone, outside the step loop and its KV budget (analysis,
        teacher forcing, timing one prefill): `capacity` rows are allocated (default: the prompt plus
        the default decode budget); decoding past them grows the cache."""
        method = self.method(method, ratio, ranking, prompt)
        with self._lock:
            self._check_servable(prompt, method, 0)
            return method.prefill(self.context, prompt, capacity or prompt.total + self.config.max_new_tokens)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        chunks: Sequence[str] = (),
        question: str | None = None,
        *,
        system: str | None = None,
        method: str | Method | None = None,
        ratio: float | str | None = None,
        ranking: str | None = None,
        sampling: SamplingConfig | None = None,
        on_token: TokenCallback | None = None,
        on_finish: FinishCallback | None = None,
        stop: StopRule | None = None,
        prompt: PromptLayout | None = None,
        prefill: Prefill | None = None,
    ) -> Request:
        """Queue a request over the cached `chunks` (ids from cache_chunk, in prompt order) and
        `question`, or over a ready `prompt`. It is served by later `step()` calls; `on_token(request,
        id)` sees every generated token as it is sampled, `stop(output_ids)` returning True ends it
        after that token (finish_reason "stop"), and `on_finish(request)` sees the end. ratio "auto"
        is the calibrated one for where the chunks are read from (auto_ratio).

        `prefill`: `prompt` already prefilled by `self.prefill(prompt, method, ratio)` (analysis code
        that times or teacher-forces that prefill too). The request then starts from it and decodes
        alone through `prefill.extend`, the call teacher forcing makes: its greedy tokens are exactly
        the argmax of the logits a teacher-forced pass over them computes (the batched decode kernel
        matches them only to rounding). Its KV lives outside the budget, and its cache stays the
        caller's (the method's `finish`, e.g. the prefix cache insert, never sees it).

        Raises (before anything is queued) for an unknown method or chunk, a prompt that does not fit
        the model's context window or could never fit the KV budget, or reuse refused by the self-check."""
        sampling = sampling or SamplingConfig(max_new_tokens=self.config.max_new_tokens)
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if prefill is not None and (prompt is None or sampling.prompt_logprobs is not None):
            raise ValueError("a ready prefill needs the prompt it was made from, and gives no prompt logprobs")
        if ratio != AUTO:
            method = self.method(method, ratio, ranking)  # a bad name fails before any chunk is looked up
        with self._lock:
            if prompt is None:
                if question is None:
                    raise ValueError("a request needs a question (or a ready prompt)")
                prompt = self.build_prompt(chunks, question, system)
            method = self.method(method, ratio, ranking, prompt)
            if prefill is None:
                self._check_servable(prompt, method, sampling.max_new_tokens)
                self.prepare(prompt, method)  # offline work (a ranking not stored): before the clock starts
            rows = 0 if prefill is not None else method.prompt_rows(prompt) + sampling.max_new_tokens
            request = Request(next(self._ids), prompt, method, sampling, rows, on_token, on_finish, stop,
                              given_prefill=prefill is not None, prefill=prefill,
                              generator=sampling.generator())
            self.scheduler.add(request)
        return request

    def abort(self, request: Request) -> None:
        """End a waiting or running request now; its KV rows are freed at once."""
        with self._lock:
            if not request.finished:
                self._end(request, RequestStatus.ABORTED, "abort")

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished

    def running_requests(self) -> list[Request]:
        """The requests admitted and not ended (a snapshot: ending one does not change it)."""
        with self._lock:
            return list(self.scheduler.running)

    def kv_usage(self) -> KVUsage:
        with self._lock:
            s = self.scheduler
            return KVUsage(s.budget.total, s.budget.used, self.kv_bytes_per_row, len(s.waiting), len(s.running))

    @torch.no_grad()
    def step(self) -> StepResult:
        """Admit waiting requests that fit and prefill each with its own method (its first token is
        sampled from the prefill), then run one decode step for every running request together."""
        with self._lock:
            finished: list[Request] = []
            start = time.perf_counter()
            admitted = self.scheduler.schedule()
            for request in admitted:
                self._prefill(request, finished)
            mid = time.perf_counter()
            # Every running request has sampled a token it has not fed yet (its first, from prefill).
            decoded = 0
            # One batched decode per model: nearly always the engine's own; a method that serves
            # with its own fine-tuned model (Block-Attention) decodes its requests apart.
            groups: dict[int, list[Request]] = {}
            alone: list[Request] = []
            for r in self.scheduler.running:
                if r.given_prefill:
                    alone.append(r)
                else:
                    groups.setdefault(id(r.prefill.adapter or self.adapter), []).append(r)
            for request in alone:  # decoded as teacher forcing decodes them (add_request's `prefill`)
                self._next_token(request, request.prefill.extend(self.adapter, [request.output_ids[-1]])[-1],
                                 finished)
                decoded += 1
            for batch in groups.values():
                adapter = batch[0].prefill.adapter or self.adapter
                logits = decode_step(adapter, [r.output_ids[-1] for r in batch], [r.prefill.cache for r in batch],
                                     [r.prefill.attention for r in batch])
                for request, row in zip(batch, logits):
                    self._next_token(request, row, finished)
                    decoded += 1
            return StepResult(finished, len(admitted), decoded, mid - start, time.perf_counter() - mid)

    def _refetched(self, prompt: PromptLayout) -> PromptLayout:
        """`prompt` with every chunk looked up again (a bad entry is dropped and re-encoded)."""
        return PromptLayout([Segment(s.token_ids, self.chunk(s.chunk.chunk_id)) if s.cached else s
                             for s in prompt.segments])

    def _prefill(self, request: Request, finished: list[Request]) -> None:
        if request.given_prefill:  # prefilled by the caller: its first token comes from that prefill
            self._started(request, request.prefill, finished)
            return
        try:
            echo = request.sampling.prompt_logprobs is not None
            with keeping_prompt_hidden() if echo else contextlib.nullcontext() as kept:
                try:
                    result = request.method.prefill(self.context, request.prompt, request.rows)
                except CorruptChunkError as exc:  # a stored chunk changed under us after it was checked
                    log.warning("request %d: %s; reading its chunks again", request.id, exc)
                    request.prompt = self._refetched(request.prompt)
                    result = request.method.prefill(self.context, request.prompt, request.rows)
            if kept is not None:
                request.prompt_logprobs = self._prompt_logprobs(request, result.prompt_rows, kept)
        except Exception as exc:  # one request's failure (a corrupt chunk...) never stops the others
            self._fail(request, exc, finished, "prefill")
            return
        self._started(request, result, finished)

    def _started(self, request: Request, result: Prefill, finished: list[Request]) -> None:
        """Record `request`'s prefill and sample its first token from it."""
        request.prefill = result
        request.computed_tokens = result.computed_tokens
        request.recomputed_tokens = result.recomputed_chunk_tokens
        self._next_token(request, result.logits, finished)

    def _prompt_logprobs(self, request: Request, prompt_rows: int, kept: PromptHidden) -> list[TokenLogprob | None]:
        """Each prompt token's logprob where the method computed the position before it; None for the
        first token and after positions served from cached chunks (and for every token of a method
        whose KV rows are not the prompt's positions: compressed chunks, link tokens)."""
        ids = request.prompt.input_ids
        out: list[TokenLogprob | None] = [None] * ids.numel()
        if kept.hidden is None or prompt_rows != ids.numel():
            return out
        rows = kept.rows.cpu()
        inside = (rows < ids.numel() - 1).nonzero().flatten()  # the last row predicts the first new token
        for block in inside.split(PROMPT_LOGITS_BLOCK):  # [block, vocab] logits at a time, not [P, vocab]
            logits = kept.adapter.logits(kept.hidden[block.to(kept.hidden.device)])
            at = rows[block]
            for pos, entry in zip(at.tolist(), token_logprobs(logits, ids[at + 1], request.sampling.prompt_logprobs)):
                out[pos + 1] = entry
        return out

    def _fail(self, request: Request, exc: BaseException, finished: list[Request], where: str) -> None:
        log.warning("request %d failed in %s: %s", request.id, where, exc)
        request.error = exc
        self._end(request, RequestStatus.FAILED, "error")
        finished.append(request)

    def _next_token(self, request: Request, logits: torch.Tensor, finished: list[Request]) -> None:
        """Sample `request`'s next token from its logits [vocab] and emit it (with its logprob when
        asked); a failure here ends this request alone."""
        try:
            token = sample(logits, request.sampling, request.generator)
            k = request.sampling.logprobs
            logprob = None if k is None else token_logprobs(logits[None], torch.tensor([token]), k)[0]
        except Exception as exc:
            self._fail(request, exc, finished, "sampling")
            return
        self._emit(request, token, finished, logprob)

    def _emit(self, request: Request, token: int, finished: list[Request], logprob: TokenLogprob | None = None
              ) -> None:
        """Record a sampled token, stream it, and end the request on a stop token, its budget or its
        stop rule."""
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        if token in self._stop_ids and not request.sampling.ignore_eos:
            self._end(request, RequestStatus.FINISHED, "stop")
            finished.append(request)
            return
        request.output_ids.append(token)
        if logprob is not None:
            request.token_logprobs.append(logprob)
        try:
            if request.on_token is not None:
                request.on_token(request, token)
            stop = request.stop is not None and request.stop(request.output_ids)
        except Exception as exc:  # a consumer that broke: end its request, keep serving the rest
            request.error = exc
            self._end(request, RequestStatus.FAILED, "error")
            finished.append(request)
            return
        if len(request.output_ids) >= request.sampling.max_new_tokens:
            self._end(request, RequestStatus.FINISHED, "length")
            finished.append(request)
        elif stop:
            self._end(request, RequestStatus.FINISHED, "stop")
            finished.append(request)

    def _end(self, request: Request, status: RequestStatus, reason: str) -> None:
        if status is RequestStatus.FINISHED and request.prefill is not None and not request.given_prefill:
            request.method.finish(self.context, request.prompt, request.prefill.cache)
        self.scheduler.remove(request)
        request.status, request.finish_reason = status, reason
        request.finished_at = time.perf_counter()
        request.prefill = None  # the KV goes with it
        if request.on_finish is not None:
            try:
                request.on_finish(request)
            except Exception:
                log.exception("on_finish callback of request %d raised", request.id)

    def eos_id(self) -> int:
        """The EOS token (C2Tokens start from its embedding); token 0 for a tokenizer without one."""
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(self.model.generation_config, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        return int(eos) if eos is not None else 0

    def stop_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return {i for i in ids if i is not None}

    def generate(
        self,
        chunks: Sequence[str] = (),
        question: str | None = None,
        system: str | None = None,
        method: str | Method | None = None,
        ratio: float | str | None = None,
        sampling: SamplingConfig | None = None,
        ranking: str | None = None,
        *,
        stop: StopRule | None = None,
        prompt: PromptLayout | None = None,
        prefill: Prefill | None = None,
    ) -> GenerationResult:
        """Answer `question` over the cached `chunks` (ids from cache_chunk, in prompt order), or a
        ready `prompt` (and its `prefill`; see add_request): one request, stepped until it ends (other
        queued requests are served along with it)."""
        request = self.add_request(chunks, question, system=system, method=method, ratio=ratio, ranking=ranking,
                                   sampling=sampling, stop=stop, prompt=prompt, prefill=prefill)
        while not request.finished:
            self.step()
        if request.error is not None:
            raise request.error
        settings = request.method.settings
        return GenerationResult(
            text=self.tokenizer.decode(request.output_ids, skip_special_tokens=True),
            token_ids=list(request.output_ids),
            ttft_ms=request.ttft_ms if request.ttft_ms is not None else 0.0,
            prompt_tokens=request.prompt_tokens,
            recomputed_tokens=request.recomputed_tokens,
            computed_tokens=request.computed_tokens,
            method=request.method.name,
            ratio=1.0 if not request.method.reuses_kv else getattr(settings, "ratio", 0.0),
            finish_reason=request.finish_reason or "",
        )
