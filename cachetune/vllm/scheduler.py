"""The connector's scheduler side: which tokens of a request the worker will fill, and with what.

Runs in vLLM's scheduler process, which holds no KV: it knows documents by their token ids (those it saw
registered, and those a request names that a shared tier holds) and finds them in prompts verbatim.
What it decides reaches the worker as `BlendJob`s and `SaveJob`s in the step's connector metadata.

Contract with vLLM's scheduler:
- `matched(request, computed)` claims one contiguous span [computed, end): from vLLM's own computed
  prefix to the prompt's last token, which stays vLLM's (it computes at least one token, and with it
  the first logits). The worker fills every row of the span, the text between and after documents
  included: its blend computes the question anyway, so vLLM computing it again would only add time.
  A request is claimed only when a document is found before its last token. `matched` has no side
  effect beyond remembering the claim for `allocated`.
- A request without cachetune parameters is looked at only when `find_documents` is on; a request
  whose cache_salt does not allow blending (config.may_blend) is never claimed.
- At most `blends_per_step` requests are claimed per step: `matched` answers None ("ask again") for
  more, so vLLM schedules them in a later step and decodes in between.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from cachetune.chunks.encode import chunk_id
from cachetune.chunks.found import DocumentIndex
from cachetune.config import parse_tiers
from cachetune.lru import LRUDict
from cachetune.model.loader import default_cache_dir
from cachetune.store.base import ChunkStore
from cachetune.store.blob import ModelShape
from cachetune.store.tiered import build_store
from cachetune.vllm.config import PARAMS_KEY, ConnectorSettings, RequestParams, may_blend

log = logging.getLogger(__name__)


@dataclass
class BlendJob:
    """Fill rows [start, end) of a request (slots from its block ids) by a blend over its prompt."""

    request_id: str
    prompt: list[int]                # every prompt token id (the blend sees the question too)
    start: int
    end: int
    documents: list[tuple[int, str]]  # (prompt position, chunk id) of each document in the prompt
    block_ids: list[int]
    method: str
    ratio: float | None


@dataclass
class SaveJob:
    """Store the KV of a registered document: prompt rows [0, len(tokens)) at the request's blocks."""

    request_id: str
    chunk_id: str
    tokens: list[int]
    block_ids: list[int]


@dataclass
class StepJobs:
    blends: list[BlendJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


@dataclass
class Claim:
    start: int
    end: int
    documents: list[tuple[int, str]]
    params: RequestParams | None


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, fingerprint: Callable[[], str],
                 stored_tokens: Callable[[str], list[int] | None]):
        self.settings = settings
        self._fingerprint = fingerprint        # called on first need (it may load the model once)
        self._stored_tokens = stored_tokens    # a named document's tokens from a shared tier, or None
        self.index = DocumentIndex(settings.documents)
        self._tokens: LRUDict[str, tuple[int, ...]] = LRUDict(settings.documents)
        self._claims: dict[str, Claim] = {}
        self._ready: dict[str, BlendJob] = {}
        self._registering: dict[str, SaveJob] = {}
        self._document_of: dict[str, str] = {}  # registration request -> its chunk id, until it ends
        self._blended: dict[str, dict] = {}      # blended request -> what its output reports, until it ends
        self.counters = {"claimed_requests": 0, "claimed_tokens": 0, "unsalted_with_documents": 0,
                         "bad_params": 0, "registered": 0}

    # ---- documents --------------------------------------------------------------------------
    def remember(self, cid: str, tokens: list[int]) -> None:
        self._tokens.put(cid, tuple(tokens))
        self.index.add(cid, list(tokens), list(tokens))

    def tokens_of(self, cid: str) -> tuple[int, ...] | None:
        tokens = self._tokens.get(cid)
        if tokens is None:
            found = self._stored_tokens(cid)
            if found:
                self.remember(cid, found)
                tokens = tuple(found)
        return tokens

    def find(self, prompt: list[int], params: RequestParams | None) -> list[tuple[int, int, str]]:
        """(start, end, chunk id) of the documents in `prompt`, left to right, not overlapping."""
        index = self.index
        if params is not None and params.documents is not None:  # only the named ones, wherever they are
            index = DocumentIndex(max(1, len(params.documents)))
            for cid in params.documents:
                tokens = self.tokens_of(cid)
                if tokens:
                    index.add(cid, list(tokens), list(tokens))
        return [(f.start, f.end, f.chunk_id) for f in index.find(prompt) if f.chunk_id is not None]

    # ---- vLLM's scheduler calls -----------------------------------------------------------------
    def matched(self, request_id: str, prompt: list[int], kv_transfer_params, cache_salt: str | None,
                computed: int) -> int | None:
        """Tokens past `computed` the worker will fill for this request (0: none; None: this step has
        its blends already, ask again in a later one)."""
        self._claims.pop(request_id, None)
        try:
            params = RequestParams.of(kv_transfer_params)
        except ValueError as exc:
            self.counters["bad_params"] += 1
            log.warning("request %s: cachetune parameters ignored: %s", request_id, exc)
            return 0
        if params is not None and params.register:
            return 0
        if params is None and not self.settings.find_documents:
            return 0
        found = [f for f in self.find(prompt, params) if f[1] < len(prompt)]  # the last token is vLLM's
        if not found:
            return 0
        if not may_blend(cache_salt):
            self.counters["unsalted_with_documents"] += 1
            return 0
        end = len(prompt) - 1
        if end <= computed:
            return 0
        limit = self.settings.blends_per_step
        if limit and len(self._ready) >= limit:
            return None
        self._claims[request_id] = Claim(computed, end, [(s, cid) for s, _, cid in found], params)
        return end - computed

    def allocated(self, request_id: str, prompt: list[int], block_ids: list[int], external: int) -> None:
        """vLLM allocated the request's blocks; `external` tokens are the connector's to fill."""
        claim = self._claims.pop(request_id, None)
        if external <= 0 or claim is None:
            return
        start = claim.end - external  # vLLM may have moved the start back to a block boundary
        params = claim.params
        method = params.method if params is not None and params.method else self.settings.method
        ratio = params.ratio if params is not None and params.ratio is not None else None
        self._ready[request_id] = BlendJob(request_id, list(prompt), start, claim.end, claim.documents,
                                           list(block_ids), method, ratio)
        self._blended[request_id] = {"documents": [cid for _, cid in claim.documents], "filled_tokens": external,
                                     "method": method}
        self.counters["claimed_requests"] += 1
        self.counters["claimed_tokens"] += external

    def registering(self, request_id: str, prompt: list[int], kv_transfer_params) -> str | None:
        """The chunk id a registration request's prompt will be stored under, or None (not one)."""
        try:
            params = RequestParams.of(kv_transfer_params)
        except ValueError:
            return None
        if params is None or not params.register:
            return None
        cid = chunk_id(self._fingerprint(), torch.tensor(prompt, dtype=torch.int64))
        self._registering[request_id] = SaveJob(request_id, cid, list(prompt), [])
        self._document_of[request_id] = cid
        return cid

    def step_jobs(self, new_requests, cached_requests, scheduled_tokens: dict[str, int]) -> StepJobs:
        """The jobs of one step: blends of requests allocated since the last step, and saves of
        registration prompts whose last token is computed in this step.

        new_requests: (id, block ids, computed tokens) of requests scheduled for the first time;
        cached_requests: (id, new block ids or None, computed tokens) of the others."""
        jobs = StepJobs(list(self._ready.values()))
        self._ready.clear()
        for request_id, block_ids, computed in [*new_requests, *cached_requests]:
            save = self._registering.get(request_id)
            if save is None:
                continue
            save.block_ids.extend(block_ids or [])
            if computed + scheduled_tokens.get(request_id, 0) >= len(save.tokens):
                jobs.saves.append(self._registering.pop(request_id))
                self.remember(save.chunk_id, save.tokens)
                self.counters["registered"] += 1
        return jobs

    def finished(self, request_id: str) -> dict | None:
        """kv_transfer_params for the finished request's output: a registration's chunk id, or a blended
        request's documents, method and the prompt tokens the connector filled (vLLM counts those among
        its cached tokens; recomputed ones included)."""
        self._claims.pop(request_id, None)
        self._ready.pop(request_id, None)
        self._registering.pop(request_id, None)  # ended before its prompt was computed: nothing saved
        cid = self._document_of.pop(request_id, None)
        blended = self._blended.pop(request_id, None)
        if cid is not None:
            return {PARAMS_KEY: {"document": cid}}
        return None if blended is None else {PARAMS_KEY: blended}


def model_shape(hf_config) -> ModelShape:
    """The KV shape of a model from its Hugging Face config (what a tier checks a stored blob against)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return ModelShape(hf_config.num_hidden_layers, hf_config.num_key_value_heads, head_dim)


class SharedTokens:
    """A document's token ids from the tiers this process can read: disk and Redis. A cpu tier lives
    in the worker's memory, so a document stored only there is known here by its registration alone."""

    def __init__(self, tiers: str, fingerprint: Callable[[], str], shape: ModelShape):
        self._specs = [t for t in parse_tiers(tiers) if t.kind in ("disk", "redis")]
        self._fingerprint, self._shape = fingerprint, shape
        self._store: ChunkStore | None = None

    def __call__(self, cid: str) -> list[int] | None:
        if not self._specs:
            return None
        if self._store is None:
            self._store = build_store(self._specs, self._fingerprint(), self._shape, torch.device("cpu"),
                                      default_cache_dir() / "chunks")
        try:
            found = self._store.get(cid)
        except Exception:  # noqa: BLE001 - a corrupt entry or an unreachable tier: not a document to claim
            return None
        return None if found is None else found.token_ids.tolist()
