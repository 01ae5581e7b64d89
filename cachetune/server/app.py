"""The OpenAI-compatible HTTP server: documents, chat and text completions, models, health, metrics.

    app = build_app(engine, ServerConfig())   # FastAPI; `serve(engine, config)` runs it under uvicorn

A request's life: the handler checks the queue bound (429) and the body, hands the request to the
engine worker (which resolves its documents, builds the prompt and queues it with the engine), then
reads tokens as the step loop makes them and sends text (SSE when `stream`). A client that goes away
has its request aborted, which frees its KV rows at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachetune.config import ServerConfig
from cachetune.engine.calibration import AUTO
from cachetune.engine.engine import Engine
from cachetune.engine.prompt import DOCUMENT_SEPARATOR
from cachetune.engine.request import Request
from cachetune.engine.selfcheck import ReuseRefusedError
from cachetune.errors import RequestError
from cachetune.runtime.decode import SamplingConfig
from cachetune.store.base import StoredChunk
from cachetune.server.http import ApiError, BodyLimit, is_loopback, param_path
from cachetune.server.metrics import CONTENT_TYPE, ServerMetrics
from cachetune.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DocumentById,
    DocumentsRequest,
    GenerationFields,
    is_document_id,
)
from cachetune.server.text import TextStream
from cachetune.server.worker import EngineWorker, TokenStream

log = logging.getLogger(__name__)


class Server:
    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.model = config.served_model_name or engine.name
        self.worker = EngineWorker(engine)
        self.metrics = ServerMetrics(self.worker)
        context = engine.max_context
        limit = config.max_prompt_tokens
        self.max_prompt_tokens = min(x for x in (limit, context) if x is not None) if (limit or context) else None
        calibrated = engine.calibrated_ratios()
        if calibrated and config.auto_ratio:
            log.info("requests without a ratio use the calibrated one (%s): %s", engine.calibration.path,
                     ", ".join(f"{tier} r={r:.3f}" for tier, r in calibrated.items()))
        scale = engine.price_scale()
        if scale is not None:
            log.info("deep_within scales deep focus's predicted price by %.3f, measured here (%s)",
                     scale, engine.calibration.path)

    # ---- checks ---------------------------------------------------------------------------------
    def authorize(self, http: HttpRequest) -> None:
        if self.config.api_key is None:
            return
        given = http.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.config.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")

    def _retry(self) -> dict:
        return {"Retry-After": str(self.config.retry_after_s)}

    def admit(self) -> None:
        """Refuse instead of queueing past the bound (429), or when no worker runs (503)."""
        if not self.worker.alive:
            self.metrics.errors.labels("unavailable").inc()
            raise ApiError(503, "the engine is not running", headers=self._retry())
        if self.worker.waiting >= self.config.max_queue:
            self.metrics.errors.labels("rejected").inc()
            raise ApiError(429, f"server busy: {self.worker.waiting} requests queued (max_queue "
                                f"{self.config.max_queue}); retry later", headers=self._retry())

    def _check_common(self, body: GenerationFields) -> int:
        if body.model is not None and body.model != self.model:
            raise ApiError(404, f"model {body.model!r} is not served here (GET /v1/models lists {self.model!r})",
                           "model")
        if len(body.documents) > self.config.max_documents:
            raise ApiError(413, f"{len(body.documents)} documents; at most {self.config.max_documents} per request",
                           "documents")
        new_tokens = body.new_tokens or self.engine.config.max_new_tokens
        if new_tokens > self.config.max_tokens:
            raise ApiError(400, f"max_tokens {new_tokens} over the server's limit of {self.config.max_tokens}",
                           "max_tokens")
        return new_tokens

    # ---- engine jobs (run on the worker thread) -------------------------------------------------
    def _register(self, text: str) -> tuple[str, int]:
        tokens = self.engine.tokenize(text + DOCUMENT_SEPARATOR)
        cid = self.engine.cache_tokens(tokens)
        return cid, int(tokens.numel())

    def _resolve(self, refs) -> list[StoredChunk]:
        """The request's documents, looked up once (inline texts registered first)."""
        found = []
        for i, ref in enumerate(refs):
            cid = ref.id if isinstance(ref, DocumentById) else ref if isinstance(ref, str) and is_document_id(ref) \
                else None
            if cid is None:
                try:
                    cid = self._register(ref if isinstance(ref, str) else ref.text)[0]
                except RequestError as exc:  # longer than the context window
                    raise ApiError(413, str(exc), f"documents[{i}]") from None
            try:
                found.append(self.engine.chunk(cid))
            except KeyError:
                raise ApiError(404, f"no document {cid}; register it with POST /v1/documents",
                               f"documents[{i}]") from None
        return found

    def _add(self, body: GenerationFields, new_tokens: int, stream: TokenStream) -> Request:
        engine = self.engine
        ratio = body.ratio
        if ratio is None and self.config.auto_ratio and engine.calibrated_ratios():
            ratio = AUTO  # calibrated for this machine: the server's default
        try:
            method = engine.method(body.method, None if ratio == AUTO else ratio)
        except (KeyError, ValueError) as exc:
            raise ApiError(400, str(exc.args[0]) if exc.args else str(exc), "method") from None
        why = method.unavailable(engine.context)
        if why:
            raise ApiError(400, f"method {method.name!r} cannot serve here: {why}", "method")
        documents = self._resolve(body.documents)
        if isinstance(body, ChatCompletionRequest):
            messages = [("system" if m.role == "developer" else m.role, m.text()) for m in body.messages]
            try:
                before, after = engine.template.chat(messages)
            except ValueError as exc:
                raise ApiError(400, str(exc), "messages") from None
        else:
            before, after = engine.template.encode(""), engine.template.encode(body.prompt)
        prompt = engine.prompt_from(before, documents, after)
        if ratio == AUTO:
            method = engine.method(body.method, AUTO, prompt=prompt)
        if self.max_prompt_tokens is not None and prompt.total + new_tokens > self.max_prompt_tokens:
            raise RequestError(f"prompt of {prompt.total} tokens plus max_tokens {new_tokens} is over the limit "
                               f"of {self.max_prompt_tokens} tokens")
        sampling = SamplingConfig(new_tokens, body.temperature, body.top_p, body.seed, ignore_eos=body.ignore_eos)
        request = engine.add_request(prompt=prompt, method=method, sampling=sampling, on_token=stream.on_token,
                                     on_finish=stream.on_finish)
        stream.request = request
        return request

    # ---- requests -------------------------------------------------------------------------------
    async def start(self, body: GenerationFields) -> tuple[Request, TokenStream, float]:
        arrived = time.perf_counter()
        self.admit()
        new_tokens = self._check_common(body)
        stream = TokenStream(asyncio.get_running_loop())
        self.worker.count_waiting(1)
        try:
            request = await self.worker.call(lambda: self._add(body, new_tokens, stream))
        except BaseException as exc:
            self.worker.count_waiting(-1)
            raise self._api_error(exc) from None
        return request, stream, arrived

    def _api_error(self, exc: BaseException) -> BaseException:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, RequestError):
            return ApiError(413, str(exc), "messages")
        if isinstance(exc, ReuseRefusedError):
            return ApiError(400, str(exc), "method")
        if isinstance(exc, (ValueError, TypeError, KeyError)):
            return ApiError(400, str(exc.args[0]) if exc.args else str(exc))
        if isinstance(exc, RuntimeError) and not self.worker.alive:
            return ApiError(503, "the engine is not running", headers=self._retry())
        log.exception("request failed", exc_info=exc)
        return ApiError(500, f"{type(exc).__name__}: {exc}")

    def abort_later(self, request: Request) -> None:
        """Abort from anywhere (a cancelled handler cannot await): queued as a job."""
        if not request.finished:
            self.worker.post(lambda: self.engine.abort(request))

    async def pieces(self, endpoint: str, request: Request, stream: TokenStream, text: TextStream
                     ) -> AsyncIterator[str]:
        """The text of `request` as it is generated; aborts the request if the consumer stops early
        (a client that went away), counted as finish_reason "abort"."""
        started = ended = False
        try:
            while True:
                token = await stream.items.get()
                if not started:
                    started = True
                    self.worker.count_waiting(-1)
                if token is None:
                    break
                delta = text.add(token)
                if delta:
                    yield delta
                if text.stopped:
                    break
            ended = True
            tail = text.flush()
            if tail:
                yield tail
        finally:
            if not started:
                self.worker.count_waiting(-1)
            self.abort_later(request)
            if not ended:
                self.metrics.requests.labels(endpoint, "abort").inc()

    def finish(self, endpoint: str, request: Request, stream: TokenStream, text: TextStream,
               arrived: float) -> tuple[str, dict, dict]:
        """(finish_reason, usage, extras) of an ended request; its metrics recorded."""
        reason = "stop" if text.stopped else (request.finish_reason or "abort")
        if request.error is not None:
            reason = "error"
        reused = max(0, request.prompt_tokens - request.computed_tokens)
        usage = {"prompt_tokens": request.prompt_tokens, "completion_tokens": len(text.ids),
                 "total_tokens": request.prompt_tokens + len(text.ids),
                 "prompt_tokens_details": {"cached_tokens": reused}}
        ttft = (stream.first_token_at or time.perf_counter()) - arrived
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


def _chunk_json(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def build_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    server = Server(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        yield
        server.worker.stop()

    app = FastAPI(title="cachetune", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)

    @app.exception_handler(ApiError)
    async def _api_error(_, exc: ApiError):
        if exc.status < 500 and exc.status not in (429, 503):
            server.metrics.errors.labels("bad_request").inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):  # unknown routes, wrong verbs: errors in one shape
        return await _api_error(None, ApiError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return await _api_error(None, ApiError(400, "the body is not valid JSON"))
        if any(tuple(e.get("loc", ())) == ("body",) for e in errors):
            return await _api_error(None, ApiError(400, "the body must be a JSON object"))
        first = errors[0] if errors else {"loc": (), "msg": "invalid body"}
        param = param_path(first.get("loc", ()))
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return await _api_error(None, ApiError(422, f"{param or 'body'}: {first.get('msg')}{more}", param or None))

    auth = Depends(server.authorize)

    @app.get("/health")
    async def health():
        if not server.worker.alive:
            return JSONResponse({"status": "stopped"}, status_code=503, headers=server._retry())
        return {"status": "ok", "model": server.model}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[auth])
    async def models():
        return {"object": "list", "data": [{"id": server.model, "object": "model", "created": 0,
                                            "owned_by": "cachetune", "max_model_len": server.max_prompt_tokens}]}

    @app.post("/v1/documents", dependencies=[auth])
    async def register(body: DocumentsRequest):
        server.admit()
        if len(body.texts) > config.max_documents:
            raise ApiError(413, f"{len(body.texts)} texts; at most {config.max_documents} per call", "texts")
        data = []
        for i, text in enumerate(body.texts):  # one job per text: decoding goes on between them
            try:
                cid, tokens = await server.worker.call(lambda text=text: server._register(text))
            except BaseException as exc:
                error = server._api_error(exc)
                if isinstance(error, ApiError) and error.param in (None, "messages"):
                    error.param = f"texts[{i}]"
                raise error from None
            server.metrics.documents.inc()
            data.append({"id": cid, "object": "document", "tokens": tokens})
        return {"object": "list", "data": data}

    def _document_id(doc_id: str) -> str:
        if not is_document_id(doc_id):
            raise ApiError(404, f"no document {doc_id[:64]!r}: ids are 32 lowercase hex digits", "id")
        return doc_id

    @app.get("/v1/documents/{doc_id}", dependencies=[auth])
    async def get_document(doc_id: str):
        cid = _document_id(doc_id)
        stored = await server.worker.call(lambda: engine.find_chunk(cid))
        if stored is None:
            raise ApiError(404, f"no document {cid}", "id")
        return {"id": cid, "object": "document", "tokens": stored.num_tokens}

    @app.delete("/v1/documents/{doc_id}", dependencies=[auth])
    async def delete_document(doc_id: str):
        cid = _document_id(doc_id)
        if not await server.worker.call(lambda: engine.remove_chunk(cid)):
            raise ApiError(404, f"no document {cid}", "id")
        return {"id": cid, "object": "document", "deleted": True}

    async def generate(http: HttpRequest, body: GenerationFields, endpoint: str):
        chat = endpoint == "chat"
        request, stream, arrived = await server.start(body)
        text = TextStream(engine.tokenizer, body.stop)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": server.model}

        def choice(delta: str | None, reason: str | None) -> dict:
            if chat:
                return {"index": 0, "delta": {} if delta is None else {"content": delta}, "finish_reason": reason,
                        "logprobs": None}
            return {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}

        if body.stream:
            async def events():
                if chat:
                    yield _chunk_json({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                            "finish_reason": None, "logprobs": None}]})
                async for delta in server.pieces(endpoint, request, stream, text):
                    yield _chunk_json({**head, "choices": [choice(delta, None)]})
                reason, usage, extras = server.finish(endpoint, request, stream, text, arrived)
                if reason == "error":
                    yield _chunk_json({"error": {"message": f"generation failed: {request.error}",
                                                 "type": "server_error", "param": None, "code": 500}})
                else:
                    last = {**head, "choices": [choice(None, reason)], "cachetune": extras}
                    yield _chunk_json(last)
                    if body.include_usage:
                        yield _chunk_json({**head, "choices": [], "usage": usage})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        parts: list[str] = []

        async def collect():
            async for delta in server.pieces(endpoint, request, stream, text):
                parts.append(delta)

        task = asyncio.create_task(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await http.is_disconnected():
                task.cancel()  # pieces() aborts the request: its KV is freed
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return Response(status_code=499)
        task.result()
        reason, usage, extras = server.finish(endpoint, request, stream, text, arrived)
        if reason == "error":
            raise ApiError(500, f"generation failed: {request.error}")
        content = "".join(parts)
        answer = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": reason,
                  "logprobs": None} if chat else {"index": 0, "text": content, "finish_reason": reason, "logprobs": None}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": server.model, "choices": [answer], "usage": usage, "cachetune": extras}

    @app.post("/v1/chat/completions", dependencies=[auth])
    async def chat_completions(http: HttpRequest, body: ChatCompletionRequest):
        return await generate(http, body, "chat")

    @app.post("/v1/completions", dependencies=[auth])
    async def completions(http: HttpRequest, body: CompletionRequest):
        return await generate(http, body, "completions")

    return app


def serve(engine: Engine, config: ServerConfig, log_level: str = "info") -> None:
    """Run the server in the foreground until interrupted."""
    import uvicorn

    if not is_loopback(config.host) and config.api_key is None:
        log.warning("listening on %s without an API key: anyone who can reach it can use it", config.host)
    uvicorn.run(build_app(engine, config), host=config.host, port=config.port, log_level=log_level,
                timeout_graceful_shutdown=5)
