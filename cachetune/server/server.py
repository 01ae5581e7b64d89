"""The server's work for one HTTP request: checks, tokenizing, handing requests to the engine worker,
and the OpenAI response (plain or streamed) built from the tokens as they come.

A request's life: the handler checks the queue bound (429), the body and the method; its texts are
measured (413 for what cannot fit, before any tokenizing) and tokenized on a tokenizer thread, so the
engine thread only runs the model; then one engine job resolves its documents (the whole request's
size checked before any document is encoded), builds each prompt and queues it with the engine. The
handler reads tokens as the step loop makes them and sends text (SSE when `stream`). A client that
goes away has its requests aborted, which frees their KV rows at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, NamedTuple

import torch
from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse

from cachetune.config import ServerConfig
from cachetune.engine.calibration import AUTO
from cachetune.engine.engine import Engine
from cachetune.engine.request import Request
from cachetune.engine.selfcheck import ReuseRefusedError
from cachetune.errors import RequestError
from cachetune.methods import check_request_method, method_settings
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.runtime.decode import SamplingConfig
from cachetune.chunks.found import DocumentIndex, Found
from cachetune.server.http import ApiError, is_loopback
from cachetune.server.metrics import ServerMetrics
from cachetune.server.protocol import ChatCompletionRequest, CompletionRequest, DocumentById, GenerationFields, \
    is_document_id
from cachetune.server.responses import TokenTexts, chat_logprobs, completion_logprobs, merge_completion_logprobs
from cachetune.server.text import TextStream
from cachetune.server.worker import EngineWorker, TokenStream
from cachetune.store.base import StoredChunk

log = logging.getLogger(__name__)


class Document(NamedTuple):
    """A document's tokens: the stored chunk's (text + separator) and the text's alone."""

    chunk: torch.Tensor
    body: torch.Tensor


class Prepared(NamedTuple):
    """A request's texts as tokens (made on the tokenizer thread)."""

    before: torch.Tensor             # ids before the documents
    afters: list[torch.Tensor]       # per prompt, ids after the documents (a completion: its prompt)
    inline: dict[int, Document]      # documents[i] given as text
    echoed: list[str | None]         # per prompt, the text an echo repeats (None: decode the prompt's ids)
    found: list[list[Found]]         # per prompt, the registered documents in it (completions without `documents`)


class Choice:
    """One prompt of a request, as the handler follows it."""

    def __init__(self, index: int, stream: TokenStream, text: TextStream, echoed: str | None):
        self.index, self.stream, self.text, self.echoed = index, stream, text, echoed
        self.request: Request | None = None


class Server:
    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.model = config.served_model_name or engine.name
        self.worker = EngineWorker(engine)
        self.metrics = ServerMetrics(self.worker)
        self.documents = DocumentIndex(engine.config.tracked_chunks)
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="cachetune-tokenize")
        self.token_texts = TokenTexts(engine.tokenizer)
        self.fingerprint = f"fp_{engine.fingerprint[:12]}"
        context = engine.max_context
        limit = config.max_prompt_tokens
        self.max_prompt_tokens = min(x for x in (limit, context) if x is not None) if (limit or context) else None
        # No token covers more UTF-8 bytes than its vocabulary string (a byte-level symbol is one
        # byte; a piece of another vocabulary at most 4 per character): a text longer than this many
        # bytes per allowed token is refused before it is tokenized.
        self.max_token_bytes = max((4 * len(t) for t in engine.tokenizer.get_vocab()), default=4) or 4
        calibrated = engine.calibrated_ratios()
        if calibrated and config.auto_ratio:
            log.info("requests without a ratio use the calibrated one (%s): %s", engine.calibration.path,
                     ", ".join(f"{tier} r={r:.3f}" for tier, r in calibrated.items()))
        scale = engine.price_scale()
        if scale is not None:
            log.info("deep_within scales deep focus's predicted price by %.3f, measured here (%s)",
                     scale, engine.calibration.path)

    def close(self) -> None:
        self.worker.stop()
        self.tokenizing.shutdown(wait=False, cancel_futures=True)

    # ---- checks ---------------------------------------------------------------------------------
    def check_host(self, http: HttpRequest) -> None:
        """A server on loopback without an API key answers only loopback names in Host: a page on
        another site whose name resolves to 127.0.0.1 (DNS rebinding) gets no answer. (A key decides
        by itself; a server bound to another address without one is open by the operator's choice.)"""
        if self.config.api_key is not None or not is_loopback(self.config.host):
            return
        host = http.headers.get("host", "")
        name = host[1:host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
        if not is_loopback(name):
            raise ApiError(403, f"Host {host[:100]!r} is not a loopback name; a server on loopback without an "
                                "API key serves only those (set --api-key to serve other names)")

    def authorize(self, http: HttpRequest) -> None:
        self.check_host(http)
        if self.config.api_key is None:
            return
        given = http.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.config.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")

    def retry_headers(self) -> dict:
        return {"Retry-After": str(self.config.retry_after_s)}

    def admit(self, count: int = 1) -> None:
        """Refuse instead of queueing past the bound (429), or when no worker runs (503)."""
        if not self.worker.alive:
            self.metrics.errors.labels("unavailable").inc()
            raise ApiError(503, "the engine is not running", headers=self.retry_headers())
        if self.worker.waiting + count > self.config.max_queue:
            self.metrics.errors.labels("rejected").inc()
            raise ApiError(429, f"server busy: {self.worker.waiting} requests queued (max_queue "
                                f"{self.config.max_queue}); retry later", headers=self.retry_headers())

    def check_fits(self, texts: list[str], param: str) -> None:
        """413 for texts that hold more tokens than a prompt may, known from their length alone."""
        if self.max_prompt_tokens is None:
            return
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if size > self.max_prompt_tokens * self.max_token_bytes:
            raise ApiError(413, f"{size} bytes of text cannot fit in {self.max_prompt_tokens} tokens", param)

    def check_request(self, body: GenerationFields) -> int:
        """The body's checks that need no tokens; returns its max new tokens."""
        if body.model is not None and body.model != self.model:
            raise ApiError(404, f"model {body.model!r} is not served here (GET /v1/models lists {self.model!r})",
                           "model")
        if len(body.document_refs) > self.config.max_documents:
            raise ApiError(413, f"{len(body.document_refs)} documents; at most {self.config.max_documents} "
                                "per request", "documents")
        new_tokens = body.new_tokens or self.engine.config.max_new_tokens
        if new_tokens > self.config.max_tokens:
            raise ApiError(400, f"max_tokens {new_tokens} over the server's limit of {self.config.max_tokens}",
                           "max_tokens")
        spec = body.method or self.engine.config.method
        try:
            check_request_method(spec, self.engine.config)
            settings = method_settings(spec)
        except ValueError as exc:
            raise ApiError(400, str(exc), "method") from None
        if body.ratio is not None and "ratio" not in getattr(settings, "__dataclass_fields__", {}):
            raise ApiError(400, f"method {spec!r} has no recompute ratio; leave ratio out", "ratio")
        return new_tokens

    # ---- tokenizing (the tokenizer thread) ------------------------------------------------------
    def document(self, text: str) -> Document:
        return Document(self.engine.template.document(text), self.engine.tokenize(text))

    def prepare(self, body: GenerationFields) -> Prepared:
        engine = self.engine
        inline = {i: self.document(ref if isinstance(ref, str) else ref.text)
                  for i, ref in enumerate(body.document_refs) if not _names_a_document(ref)}
        if isinstance(body, ChatCompletionRequest):
            roles = {"developer": "system"}
            messages = [(roles.get(m.role, m.role), m.text()) for m in body.messages]
            calls = {i: [(c.function.name, c.function.arguments) for c in m.tool_calls]
                     for i, m in enumerate(body.messages) if m.tool_calls}
            try:
                before, after = engine.template.chat(messages, calls)
            except ValueError as exc:
                raise ApiError(400, str(exc), "messages") from None
            return Prepared(before, [after], inline, [None], [[]])
        afters, echoed = [], []
        for i, prompt in enumerate(body.prompts):
            if isinstance(prompt, str):
                afters.append(engine.template.encode(prompt))
                echoed.append(prompt)
            else:
                if max(prompt) >= engine.vocab_size:
                    raise ApiError(400, f"token ids must be below the vocabulary size {engine.vocab_size}",
                                   f"prompt[{i}]" if len(body.prompts) > 1 else "prompt")
                afters.append(torch.tensor(prompt, dtype=torch.int64))
                echoed.append(None)
        # Searched here, off the engine thread; used only by methods that reuse KV (`_layout`).
        search = self.config.find_documents and not body.document_refs
        found = [self.documents.find(after.tolist()) if search else [] for after in afters]
        return Prepared(torch.empty(0, dtype=torch.int64), afters, inline, echoed, found)

    def texts_of(self, body: GenerationFields) -> list[str]:
        docs = [r if isinstance(r, str) else r.text for r in body.document_refs if not _names_a_document(r)]
        if isinstance(body, ChatCompletionRequest):
            calls = [c.function.name + c.function.arguments for m in body.messages for c in m.tool_calls or ()]
            return docs + [m.text() for m in body.messages] + calls
        return docs + [p for p in body.prompts if isinstance(p, str)]

    # ---- engine jobs (run on the worker thread) -------------------------------------------------
    def register(self, document: Document) -> str:
        cid = self.engine.cache_tokens(document.chunk)
        self.documents.add(cid, document.body.tolist(), document.chunk.tolist())
        return cid

    def forget(self, cid: str) -> bool:
        self.documents.remove(cid)
        return self.engine.remove_chunk(cid)

    def _resolve(self, body: GenerationFields, prepared: Prepared, new_tokens: int) -> list[StoredChunk]:
        """The request's documents, looked up once; inline texts are registered only after the whole
        request is known to fit (a request refused for its size encodes nothing)."""
        refs = body.document_refs
        found: dict[int, StoredChunk] = {}
        for i, ref in enumerate(refs):
            if i not in prepared.inline:
                cid = ref.id if isinstance(ref, DocumentById) else ref
                stored = self.engine.find_chunk(cid)
                if stored is not None:
                    found[i] = stored
        tokens = prepared.before.numel() + max(a.numel() for a in prepared.afters) + new_tokens \
            + sum(s.num_tokens for s in found.values()) + sum(d.chunk.numel() for d in prepared.inline.values())
        if self.max_prompt_tokens is not None and tokens > self.max_prompt_tokens:
            raise RequestError(f"prompt of at least {tokens - new_tokens} tokens plus max_tokens {new_tokens} is over "
                               f"the limit of {self.max_prompt_tokens} tokens")
        out = []
        for i, ref in enumerate(refs):
            try:
                if i in prepared.inline:
                    out.append(self.engine.chunk(self.register(prepared.inline[i])))
                else:
                    out.append(found.get(i) or self.engine.chunk(ref.id if isinstance(ref, DocumentById) else ref))
            except KeyError:
                raise ApiError(404, f"no document {ref.id if isinstance(ref, DocumentById) else ref}; register it "
                                    "with POST /v1/documents", f"documents[{i}]") from None
            except RequestError as exc:
                raise ApiError(413, str(exc), f"documents[{i}]") from None
        return out

    def _layout(self, before: torch.Tensor, documents: list[StoredChunk], after: torch.Tensor, found: list[Found],
                reuses_kv: bool) -> PromptLayout:
        """The prompt; a completion prompt without `documents`, for a method that reuses KV, gets the
        registered documents `found` in it."""
        found = [hit for hit in found if hit.end < after.numel()]  # the prompt's last token is always computed
        if not found or not reuses_kv:
            return self.engine.prompt_from(before, documents, after)
        segments, at = [], 0
        for hit in found:
            if hit.start > at:
                segments.append(Segment(after[at:hit.start]))
            span = after[hit.start:hit.end]
            stored = self.engine.find_chunk(hit.chunk_id) if hit.chunk_id else None
            # The text alone, or a registered chunk no tier holds any more: encoded from the prompt's own
            # tokens (once: later prompts find it stored).
            segments.append(Segment(span, stored or self.engine.chunk(self.engine.cache_tokens(span))))
            at = hit.end
        if at < after.numel():
            segments.append(Segment(after[at:]))
        return PromptLayout(segments)

    def _add(self, body: GenerationFields, prepared: Prepared, new_tokens: int, choices: list[Choice]) -> None:
        engine = self.engine
        ratio = engine.request_ratio(body.ratio, self.config.auto_ratio)
        try:
            method = engine.method(body.method, None if ratio == AUTO else ratio)
        except (KeyError, ValueError) as exc:
            raise ApiError(400, str(exc.args[0]) if exc.args else str(exc), "method") from None
        why = engine.unavailable(method)
        if why:
            raise ApiError(400, f"method {method.name!r} cannot serve here: {why}", "method")
        documents = self._resolve(body, prepared, new_tokens)
        prompts = [self._layout(prepared.before, documents, after, found, method.reuses_kv)
                   for after, found in zip(prepared.afters, prepared.found)]
        for prompt in prompts:
            if self.max_prompt_tokens is not None and prompt.total + new_tokens > self.max_prompt_tokens:
                raise RequestError(f"prompt of {prompt.total} tokens plus max_tokens {new_tokens} is over the limit "
                                   f"of {self.max_prompt_tokens} tokens")
        echo = isinstance(body, CompletionRequest) and body.echo
        for choice, prompt in zip(choices, prompts):
            sampling = SamplingConfig(new_tokens, 1.0 if body.temperature is None else body.temperature,
                                      1.0 if body.top_p is None else body.top_p, body.seed,
                                      ignore_eos=bool(body.ignore_eos), logprobs=body.logprobs_top,
                                      prompt_logprobs=(body.logprobs_top or 0) if echo else None)
            request_method = engine.method(body.method, AUTO, prompt=prompt) if ratio == AUTO else method
            try:
                choice.request = engine.add_request(prompt=prompt, method=request_method, sampling=sampling,
                                                    on_token=choice.stream.on_token, on_finish=choice.stream.on_finish)
            except BaseException:
                for added in choices:  # all prompts of a request are served, or none
                    if added.request is not None:
                        engine.abort(added.request)
                raise

    # ---- requests -------------------------------------------------------------------------------
    async def start(self, body: GenerationFields) -> tuple[list[Choice], float]:
        arrived = time.perf_counter()
        count = len(body.prompts) if isinstance(body, CompletionRequest) else 1
        if count > self.config.max_queue:
            raise ApiError(400, f"{count} prompts; at most {self.config.max_queue} (max_queue) per request", "prompt")
        self.admit(count)
        new_tokens = self.check_request(body)
        self.check_fits(self.texts_of(body), body.prompt_field)
        loop = asyncio.get_running_loop()
        self.worker.count_waiting(count)
        try:
            prepared = await loop.run_in_executor(self.tokenizing, self.prepare, body)
            choices = [Choice(i, TokenStream(loop), TextStream(self.engine.tokenizer, body.stop), echoed)
                       for i, echoed in enumerate(prepared.echoed)]
            await self.worker.call(lambda: self._add(body, prepared, new_tokens, choices))
        except BaseException as exc:
            self.worker.count_waiting(-count)
            raise self.api_error(exc, body.prompt_field) from None
        return choices, arrived

    def api_error(self, exc: BaseException, param: str | None = None) -> BaseException:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, RequestError):
            return ApiError(413, str(exc), param)
        if isinstance(exc, ReuseRefusedError):
            return ApiError(400, str(exc), "method")
        if isinstance(exc, (ValueError, TypeError, KeyError)):
            return ApiError(400, str(exc.args[0]) if exc.args else str(exc), param)
        if isinstance(exc, RuntimeError) and not self.worker.alive:
            return ApiError(503, "the engine is not running", headers=self.retry_headers())
        log.exception("request failed", exc_info=exc)
        return ApiError(500, f"{type(exc).__name__}: {exc}")

    def abort_later(self, request: Request | None) -> None:
        """Abort from anywhere (a cancelled handler cannot await): queued as a job."""
        if request is not None and not request.finished:
            self.worker.post(lambda: self.engine.abort(request))

    async def pieces(self, endpoint: str, choice: Choice) -> AsyncIterator[tuple[str, list]]:
        """(text, logprob entries of the tokens behind it) of one choice as it is generated; aborts
        its request if the consumer stops early (a client that went away: finish_reason "abort")."""
        started = ended = False
        text, pending = choice.text, []
        try:
            while True:
                item = await choice.stream.items.get()
                if not started:
                    started = True
                    self.worker.count_waiting(-1)
                if item is None:
                    break
                token, logprob = item
                if logprob is not None:
                    pending.append(logprob)
                delta = text.add(token)
                if delta or (pending and text.stopped):
                    yield delta, pending
                    pending = []
                if text.stopped:
                    break
            ended = True
            tail = text.flush()
            if tail or pending:
                yield tail, pending
        finally:
            if not started:
                self.worker.count_waiting(-1)
            self.abort_later(choice.request)
            if not ended:
                self.metrics.requests.labels(endpoint, "abort").inc()

    def finish(self, endpoint: str, choice: Choice, arrived: float) -> tuple[str, dict, dict]:
        """(finish_reason, usage, extras) of an ended choice; its metrics recorded."""
        request, text = choice.request, choice.text
        reason = "stop" if text.stopped else (request.finish_reason or "abort")
        if request.error is not None:
            reason = "error"
        reused = max(0, request.prompt_tokens - request.computed_tokens)
        usage = {"prompt_tokens": request.prompt_tokens, "completion_tokens": len(text.ids),
                 "total_tokens": request.prompt_tokens + len(text.ids),
                 "prompt_tokens_details": {"cached_tokens": reused}}
        ttft = (choice.stream.first_token_at or time.perf_counter()) - arrived
        method = request.method
        extras = {"method": method.name, "ratio": getattr(method.settings, "ratio", None) if method.reuses_kv else 1.0,
                  "documents": [seg.chunk.chunk_id for _, seg in request.prompt.chunk_segments],
                  "reused_tokens": reused, "recomputed_tokens": request.recomputed_tokens,
                  "computed_tokens": request.computed_tokens, "ttft_ms": round(ttft * 1000, 3)}
        m = self.metrics
        m.requests.labels(endpoint, reason).inc()
        if reason == "error":
            m.errors.labels("engine").inc()
        elif request.computed_tokens:
            m.ttft.labels(method.name).observe(ttft)
            m.latency.labels(method.name).observe(time.perf_counter() - arrived)
            m.prompt_tokens.inc(request.prompt_tokens)
            m.reused_tokens.inc(reused)
            m.recomputed_tokens.inc(request.recomputed_tokens)
            m.generation_tokens.inc(len(text.ids))
        return reason, usage, extras

    # ---- responses ------------------------------------------------------------------------------
    def _echo(self, choice: Choice, logprobs: bool) -> tuple[str, dict | None]:
        """The echoed prompt's text and, when asked, its logprobs."""
        ids = choice.request.prompt.input_ids.tolist()
        text = choice.echoed if choice.echoed is not None else self.engine.tokenizer.decode(ids)
        entries = choice.request.prompt_logprobs or [None] * len(ids)
        return text, completion_logprobs(self.token_texts, ids, entries) if logprobs else None

    def _logprobs(self, chat: bool, entries: list, offset: int) -> dict:
        if chat:
            return chat_logprobs(self.token_texts, entries)
        return completion_logprobs(self.token_texts, [e.token for e in entries], entries, offset)

    async def generate(self, http: HttpRequest, body: GenerationFields, endpoint: str) -> Response | dict:
        chat = endpoint == "chat"
        choices, arrived = await self.start(body)
        wants_logprobs = body.logprobs_top is not None
        echo = not chat and bool(body.echo)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model, "system_fingerprint": self.fingerprint}
        if body.stream:
            return StreamingResponse(self._events(endpoint, body, choices, arrived, head, wants_logprobs, echo),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts: dict[int, list[tuple[str, list]]] = {c.index: [] for c in choices}

        async def collect(choice: Choice):
            async for piece in self.pieces(endpoint, choice):
                parts[choice.index].append(piece)

        task = asyncio.ensure_future(asyncio.gather(*(collect(c) for c in choices)))
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await http.is_disconnected():
                task.cancel()  # pieces() aborts the requests: their KV is freed
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return Response(status_code=499)
        task.result()
        answers, usages, extras = [], [], []
        for choice in choices:
            reason, usage, extra = self.finish(endpoint, choice, arrived)
            if reason == "error":
                raise ApiError(500, f"generation failed: {choice.request.error}")
            usages.append(usage)
            extras.append(extra)
            content = "".join(text for text, _ in parts[choice.index])
            entries = [e for _, pending in parts[choice.index] for e in pending]
            logprobs = None
            if chat:
                logprobs = self._logprobs(True, entries, 0) if wants_logprobs else None
                answers.append({"index": choice.index, "message": {"role": "assistant", "content": content},
                                "finish_reason": reason, "logprobs": logprobs})
                continue
            prefix = ""
            if echo:
                prefix, echoed = self._echo(choice, wants_logprobs)
                if wants_logprobs:
                    logprobs = merge_completion_logprobs([echoed, self._logprobs(False, entries, len(prefix))])
            elif wants_logprobs:
                logprobs = self._logprobs(False, entries, 0)
            answers.append({"index": choice.index, "text": prefix + content, "finish_reason": reason,
                            "logprobs": logprobs})
        head = {**head, "object": "chat.completion" if chat else "text_completion"}
        return {**head, "choices": answers, "usage": _total(usages),
                "cachetune": extras[0] if len(extras) == 1 else extras}

    async def _put_echo(self, queue: asyncio.Queue, event, choice: Choice, wants_logprobs: bool) -> int:
        """Queue the echoed prompt of `choice` as one event; returns its text's length."""
        text, logprobs = self._echo(choice, wants_logprobs)
        await queue.put(event(choice.index, text, None, logprobs))
        return len(text)

    async def _events(self, endpoint: str, body: GenerationFields, choices: list[Choice], arrived: float,
                      head: dict, wants_logprobs: bool, echo: bool) -> AsyncIterator[str]:
        chat = endpoint == "chat"
        usage_field = {"usage": None} if body.include_usage else {}

        def event(choice_index: int, delta: str | None, reason: str | None, logprobs: dict | None, **more) -> str:
            if chat:
                part = {"index": choice_index, "delta": {} if delta is None else {"content": delta},
                        "finish_reason": reason, "logprobs": logprobs}
            else:
                part = {"index": choice_index, "text": delta or "", "finish_reason": reason, "logprobs": logprobs}
            return _sse({**head, "choices": [part], **usage_field, **more})

        queue: asyncio.Queue = asyncio.Queue()

        async def follow(choice: Choice):
            offset = 0
            try:
                if chat:
                    await queue.put(_sse({**head, "choices": [{"index": choice.index,
                                                               "delta": {"role": "assistant", "content": ""},
                                                               "finish_reason": None, "logprobs": None}],
                                          **usage_field}))
                echoed = not echo  # the prompt's logprobs exist once its first token came
                async for delta, entries in self.pieces(endpoint, choice):
                    if not echoed:
                        echoed, offset = True, await self._put_echo(queue, event, choice, wants_logprobs)
                    logprobs = self._logprobs(chat, entries, offset) if wants_logprobs else None
                    offset += len(delta)
                    await queue.put(event(choice.index, delta, None, logprobs))
                if not echoed and choice.request is not None and choice.request.error is None:
                    await self._put_echo(queue, event, choice, wants_logprobs)
            finally:
                await queue.put(choice)  # this choice is done

        tasks = [asyncio.ensure_future(follow(c)) for c in choices]
        usages, extras, failed = [], [], None
        try:
            done = 0
            while done < len(choices):
                item = await queue.get()
                if isinstance(item, str):
                    yield item
                    continue
                done += 1
                reason, usage, extra = self.finish(endpoint, item, arrived)
                usages.append(usage)
                extras.append(extra)
                if reason == "error":
                    failed = item.request.error
                    continue
                yield event(item.index, None, reason, None, cachetune=extra)
            if failed is not None:
                yield _sse({"error": {"message": f"generation failed: {failed}", "type": "server_error",
                                      "param": None, "code": 500}})
            elif body.include_usage:
                yield _sse({**head, "choices": [], "usage": _total(usages)})
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()


def _names_a_document(ref) -> bool:
    return isinstance(ref, DocumentById) or (isinstance(ref, str) and is_document_id(ref))


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _total(usages: list[dict]) -> dict:
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    total["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                                           for u in usages)}
    return total
