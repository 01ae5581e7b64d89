"""The Engine facade: cache chunks once, then answer requests assembled from them.

    engine = Engine.from_pretrained()                       # bundled SmolLM2-135M-Instruct
    ids = [engine.cache_chunk(text) for text in docs]
    out = engine.generate(chunks=ids, question="...", method="cachetune", ratio=0.15)
    out.text, out.ttft_ms, out.recomputed_tokens
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Sequence

import torch

from cachetune.chunks.encode import chunk_id, encode_chunk
from cachetune.chunks.probes import PROBE_PASSAGES, ProbeBank
from cachetune.chunks.rankers import ChunkView, FusionRanker, Ranker, RankingContext, get_ranker
from cachetune.chunks.ranking import rank_fusion, ranking_from_scores
from cachetune.config import EngineConfig
from cachetune.engine.ape import APEConfig, ape_prefill
from cachetune.engine.decode import SamplingConfig, generate_tokens
from cachetune.engine.layout import PromptLayout, Segment
from cachetune.engine.prefill import PrefillResult, full_prefill, prefix_prefill, pruned_prefill, selective_prefill
from cachetune.engine.prefix_cache import PrefixCache
from cachetune.engine.prompt import DEFAULT_SYSTEM, QUESTION_LABEL, PromptTemplate
from cachetune.engine.selfcheck import ReuseRefusedError, run_self_check
from cachetune.model.adapter import ModelAdapter
from cachetune.model.loader import LoadedModel, default_cache_dir, load_model, model_fingerprint
from cachetune.selectors import SELECTORS, SelectionRequest, TokenSelector, get_selector, is_selector
from cachetune.store.base import ChunkStore, CorruptChunkError, StoredChunk
from cachetune.store.disk import DiskStore
from cachetune.store.memory import MemoryStore

log = logging.getLogger(__name__)

FULL_RECOMPUTE = "full_recompute"
PREFIX = "prefix"
APE = "ape"
# Exact methods (their KV may seed the prefix cache), then reuse methods with their own prefill.
PREFILL_METHODS = (FULL_RECOMPUTE, PREFIX)
METHODS = (*PREFILL_METHODS, APE, *SELECTORS)  # plus "cachetune:<ranker>" (see is_method)


def is_method(name: str) -> bool:
    """A method name Engine.prefill accepts: one of METHODS or cachetune with a named ranking."""
    return name in METHODS or is_selector(name)


def _with_ranking(method: str | TokenSelector, ranking: str | None) -> str | TokenSelector:
    """"cachetune" with ranking="probe" is the method "cachetune:probe"; other methods take no ranking."""
    if ranking is None:
        return method
    if method != "cachetune":
        raise ValueError(f"ranking= applies to the cachetune method, not {method!r}")
    return f"cachetune:{ranking}"


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    ttft_ms: float            # request start (layout) to the first sampled token
    prompt_tokens: int
    recomputed_tokens: int    # chunk tokens recomputed in context (all of them for full_recompute)
    computed_tokens: int      # all tokens that went through the layers during prefill
    method: str
    ratio: float


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, store: ChunkStore | None = None):
        self.config = config or EngineConfig()
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self.model = loaded.model.to(self.config.torch_device)
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name
        self.adapter = ModelAdapter(self.model)
        self.fingerprint = model_fingerprint(self.model)
        self.template = PromptTemplate(self.tokenizer)
        self.store = store or self._default_store()
        self._tokens: dict[str, torch.Tensor] = {}  # ids cached by this engine, to re-encode after corruption
        self._scores: dict[tuple[str, str], torch.Tensor] = {}  # (chunk id, ranker) -> offline scores
        self._rankers: dict[str | None, Ranker] = {}
        self._ranking_context: RankingContext | None = None
        self.prefix_cache = PrefixCache()
        self.ape_config = APEConfig()
        self.reuse_error: str | None = None
        self.self_check_error: float | None = None
        if self.config.self_check:
            try:
                self.self_check_error = run_self_check(self.adapter, self.fingerprint, self.model.config.vocab_size)
            except ReuseRefusedError as exc:
                self.reuse_error = str(exc)
                log.error("%s", exc)

    @classmethod
    def from_pretrained(cls, spec: str | None = None, config: EngineConfig | None = None, **overrides) -> "Engine":
        """Load a preset, HF directory or .gguf file. Keyword overrides are EngineConfig fields."""
        config = replace(config or EngineConfig(), **({"model": spec} if spec else {}), **overrides)
        return cls(load_model(config.model, dtype=config.torch_dtype), config)

    def _default_store(self) -> ChunkStore:
        if self.config.store == "memory":
            return MemoryStore()
        root = Path(self.config.store_dir) if self.config.store_dir else default_cache_dir() / "chunks"
        return DiskStore(root, self.fingerprint)

    # ---- chunks -------------------------------------------------------------------------------
    def tokenize(self, text: str) -> torch.Tensor:
        return self.template.encode(text)

    def cache_chunk(self, text: str) -> str:
        """Encode `text` on its own once, rank its tokens and store it; returns its content-address id."""
        return self.cache_tokens(self.tokenize(text))

    def cache_tokens(self, token_ids: torch.Tensor) -> str:
        """Like cache_chunk for text already tokenized (the ids are used exactly as given)."""
        cid = chunk_id(self.fingerprint, token_ids)
        self._tokens[cid] = token_ids
        if self._lookup(cid) is None:
            self.store.put(self._encode(token_ids))
        return cid

    def _lookup(self, cid: str) -> StoredChunk | None:
        try:
            return self.store.get(cid)
        except CorruptChunkError as exc:
            log.warning("dropped corrupt chunk %s: %s", cid, exc)
            return None

    def chunk(self, cid: str) -> StoredChunk:
        """The stored chunk; a missing or corrupt one is re-encoded if this engine knows its tokens."""
        stored = self._lookup(cid)
        if stored is None and cid in self._tokens:
            self.store.put(self._encode(self._tokens[cid]))
            stored = self.store.get(cid)
        if stored is None:
            raise KeyError(f"chunk {cid} is not in the store; cache its text with cache_chunk() first")
        return stored

    def _encode(self, token_ids: torch.Tensor):
        ranker = self.ranker()
        context = self.ranking_context() if ranker.needs_model else None
        return encode_chunk(self.adapter, token_ids, self.fingerprint, ranker, context)

    def ranker(self, spec: str | None = None) -> Ranker:
        """The offline ranker named `spec` (None: the configured default, stored with every chunk)."""
        if spec not in self._rankers:
            self._rankers[spec] = get_ranker(spec or self.config.ranking, self.config.alpha)
        return self._rankers[spec]

    def ranking_context(self) -> RankingContext:
        """Model and probe prefixes for rankers that run the model; probes are encoded on first use.

        Probe 0 is the prompt head a request puts before its documents (template start, default system
        prompt); probe i > 0 is that head followed by PROBE_PASSAGES[i-1] and the document separator."""
        if self._ranking_context is None:
            head = self.template.segments(DEFAULT_SYSTEM, "")[0]
            passages = [torch.cat([head, self.tokenize(p + "\n\n")]) for p in PROBE_PASSAGES]
            bos = getattr(self.tokenizer, "bos_token_id", None)
            self._ranking_context = RankingContext(self.adapter, ProbeBank(self.adapter, [head, *passages]), bos)
        return self._ranking_context

    def scores(self, chunk: StoredChunk, spec: str | None = None) -> torch.Tensor:
        """The chunk's offline scores [N] by a named ranker: the stored ones when the chunk was cached
        with that ranker, otherwise computed once and kept.

        Computing scores other than the stored ones reads every layer of the chunk from its tier (and
        a probe ranker runs the model); callers that time requests ask before the clock starts."""
        ranker = self.ranker(spec)
        if chunk.ranker == ranker.name:
            return chunk.scores
        key = (chunk.chunk_id, ranker.name)
        if key not in self._scores and isinstance(ranker, FusionRanker):
            # A hybrid's parts are rankings in their own right: reuse (and keep) theirs.
            self._scores[key] = rank_fusion([self.scores(chunk, part.name) for part in ranker.parts])
        if key not in self._scores:
            every = torch.arange(chunk.num_tokens)
            layers = [chunk.load_layer(layer, every) for layer in range(self.adapter.num_layers)]
            keys = torch.stack([k for k, _ in layers])  # [L, N, Hkv, D]
            values = torch.stack([v for _, v in layers])
            context = self.ranking_context() if ranker.needs_model else None
            self._scores[key] = ranker.scores(ChunkView(chunk.token_ids, keys, values, context))
        return self._scores[key]

    def ranking(self, chunk: StoredChunk, spec: str | None = None) -> torch.Tensor:
        """Local token indices, most worth recomputing first, by a named ranker (see `scores`)."""
        if chunk.ranker == self.ranker(spec).name:
            return chunk.ranking
        return ranking_from_scores(self.scores(chunk, spec))

    def cache_prefix(self, token_ids: torch.Tensor) -> int:
        """Run a plain prefill of `token_ids` and keep its full blocks in the prefix cache.

        The prefix method reuses these blocks exactly where a later prompt starts with the same
        tokens (what a vLLM server holds after serving that text). Returns the number cached."""
        full_blocks = (token_ids.numel() // self.prefix_cache.block_size) * self.prefix_cache.block_size
        # match() never counts the last token, so probe with one more: are all full blocks cached?
        if self.prefix_cache.match(torch.cat([token_ids, token_ids[:1]])) >= full_blocks:
            return full_blocks
        layout = PromptLayout([Segment(token_ids)])
        result = full_prefill(self.adapter, layout, layout.total)
        self.prefix_cache.insert(token_ids, result.cache)
        return full_blocks

    # ---- requests -----------------------------------------------------------------------------
    def layout(self, chunks: Sequence[str], question: str, system: str | None = None,
               label: str = QUESTION_LABEL, preamble: torch.Tensor | None = None) -> PromptLayout:
        """Template start + system prompt, the cached chunks in the given order, then the question
        (after `label`; pass "" when `question` is the complete text that follows the documents).
        `preamble`: token ids of uncached text placed between the system prompt and the chunks."""
        before, after = self.template.segments(DEFAULT_SYSTEM if system is None else system, question, label)
        if preamble is not None and preamble.numel():
            before = torch.cat([before, preamble])
        stored = [self.chunk(cid) for cid in chunks]
        return PromptLayout([Segment(before), *(Segment(c.token_ids, c) for c in stored), Segment(after)])

    def prefill(self, layout: PromptLayout, method: str | TokenSelector = "cachetune", ratio: float = 0.15,
                extra_capacity: int = 64, ranking: str | None = None) -> PrefillResult:
        """Fill the KV cache for `layout` with `method` (a name in METHODS, "cachetune:<ranker>", or a
        TokenSelector instance); `extra_capacity` rows are reserved for decoding. `ranking` picks the
        offline ranker of the cachetune method (default: EngineConfig.ranking)."""
        method = _with_ranking(method, ranking)
        if isinstance(method, str) and not is_method(method):
            raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}, cachetune:<ranker>")
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        capacity = layout.total + extra_capacity
        if method == FULL_RECOMPUTE:
            return full_prefill(self.adapter, layout, capacity)
        if method == PREFIX:  # exact KV at the same positions: lossless, no self-check needed
            return prefix_prefill(self.adapter, layout, self.prefix_cache, capacity)
        if self.reuse_error is not None:
            raise ReuseRefusedError(self.reuse_error)
        if method == APE:
            return ape_prefill(self.adapter, layout, capacity, self.ape_config)
        selector = get_selector(method) if isinstance(method, str) else method
        request = SelectionRequest(layout, self.adapter, self)
        selections = selector.select(request, ratio)
        if selector.drops_unselected:
            return pruned_prefill(self.adapter, layout, selections, capacity)
        fuse = selector.fusion(request, selections)
        return selective_prefill(self.adapter, layout, selections, capacity, self.config.prefetch, fuse=fuse)

    def stop_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return {i for i in ids if i is not None}

    @torch.no_grad()
    def start_request(
        self,
        chunks: Sequence[str],
        question: str,
        system: str | None = None,
        method: str | TokenSelector = "cachetune",
        ratio: float = 0.15,
        extra_capacity: int = 64,
        label: str = QUESTION_LABEL,
        preamble: torch.Tensor | None = None,
        ranking: str | None = None,
    ) -> tuple[PrefillResult, float]:
        """Everything a request pays before its first token: layout, selection, loading, prefill.

        Returns the prefill and the time to the first token in ms (the argmax over the first logits
        is included; sampling costs the same for every method).
        """
        start = time.perf_counter()
        layout = self.layout(chunks, question, system, label, preamble)
        result = self.prefill(layout, method, ratio, extra_capacity, ranking)
        int(torch.argmax(result.logits))  # reading the id waits for a GPU's queued kernels
        return result, (time.perf_counter() - start) * 1000

    @torch.no_grad()
    def generate(
        self,
        chunks: Sequence[str],
        question: str,
        system: str | None = None,
        method: str = "cachetune",
        ratio: float = 0.15,
        sampling: SamplingConfig | None = None,
        ranking: str | None = None,
    ) -> GenerationResult:
        """Answer `question` over the cached `chunks` (ids from cache_chunk, in prompt order).
        `ranking`: the cachetune method's offline ranker (default: EngineConfig.ranking)."""
        sampling = sampling or SamplingConfig()
        method = _with_ranking(method, ranking)
        result, ttft_ms = self.start_request(chunks, question, system, method, ratio, sampling.max_new_tokens)
        step = partial(result.extend, self.adapter)
        tokens = generate_tokens(step, result.logits, sampling, self.stop_ids())
        if method in PREFILL_METHODS:
            # Like vLLM's automatic prefix caching, remember served prompts; only exact KV goes in,
            # never the approximate KV of a reuse method.
            self.prefix_cache.insert(self.layout(chunks, question, system).input_ids, result.cache)
        return GenerationResult(
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            token_ids=tokens,
            ttft_ms=ttft_ms,
            prompt_tokens=result.prompt_tokens,
            recomputed_tokens=result.recomputed_chunk_tokens,
            computed_tokens=result.computed_tokens,
            method=method,
            ratio=ratio if method != FULL_RECOMPUTE else 1.0,
        )
