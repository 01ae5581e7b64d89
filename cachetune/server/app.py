"""The OpenAI-compatible HTTP server: documents, chat and text completions, models, health, metrics.

    app = build_app(engine, ServerConfig())   # FastAPI; `serve(engine, config)` runs it under uvicorn

The routes are thin: each checks what it can without the engine and hands the work to the `Server`
(server.py), whose one worker thread owns the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import Depends, FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachetune.config import ServerConfig
from cachetune.engine.engine import Engine
from cachetune.server.http import ApiError, BodyLimit, is_loopback, param_path
from cachetune.server.metrics import CONTENT_TYPE
from cachetune.server.protocol import ChatCompletionRequest, CompletionRequest, DocumentsRequest, is_document_id
from cachetune.server.server import Server

log = logging.getLogger(__name__)


def build_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    server = Server(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        yield
        server.close()

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
        if any(tuple(e.get("loc", ())) == ("body",) and e.get("type") != "value_error" for e in errors):
            return await _api_error(None, ApiError(400, "the body must be a JSON object"))
        first = errors[0] if errors else {"loc": (), "msg": "invalid body"}
        param = param_path(first.get("loc", ()))
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return await _api_error(None, ApiError(422, f"{param or 'body'}: {first.get('msg')}{more}", param or None))

    auth = Depends(server.authorize)

    @app.get("/health")
    async def health():
        if not server.worker.alive:
            return JSONResponse({"status": "stopped"}, status_code=503, headers=server.retry_headers())
        return {"status": "ok", "model": server.model}

    @app.get("/metrics", dependencies=[Depends(server.check_host)])
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": server.model, "object": "model", "created": 0, "owned_by": "cachetune",
                "max_model_len": server.max_prompt_tokens}

    @app.get("/v1/models", dependencies=[auth])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[auth])
    async def model(model_id: str):
        if model_id != server.model:
            raise ApiError(404, f"model {model_id[:100]!r} is not served here (this server serves {server.model!r})",
                           "model")
        return model_card()

    @app.post("/v1/documents", dependencies=[auth])
    async def register(body: DocumentsRequest):
        if len(body.texts) > config.max_documents:
            raise ApiError(413, f"{len(body.texts)} texts; at most {config.max_documents} per call", "texts")
        server.admit()  # registration is engine work: one queued job per call, bounded like completions
        for i, text in enumerate(body.texts):
            server.check_fits([text], f"texts[{i}]")
        loop = asyncio.get_running_loop()
        server.worker.count_waiting(1)
        data = []
        try:
            for i, text in enumerate(body.texts):  # one job per text: decoding goes on between them
                try:
                    document = await loop.run_in_executor(server.tokenizing, server.document, text)
                    cid = await server.worker.call(lambda document=document: server.register(document))
                except BaseException as exc:
                    raise server.api_error(exc, f"texts[{i}]") from None
                server.metrics.documents.inc()
                data.append({"id": cid, "object": "document", "tokens": int(document.chunk.numel())})
        finally:
            server.worker.count_waiting(-1)
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
        if not await server.worker.call(lambda: server.forget(cid)):
            raise ApiError(404, f"no document {cid}", "id")
        return {"id": cid, "object": "document", "deleted": True}

    @app.post("/v1/chat/completions", dependencies=[auth])
    async def chat_completions(http: HttpRequest, body: ChatCompletionRequest):
        return await server.generate(http, body, "chat")

    @app.post("/v1/completions", dependencies=[auth])
    async def completions(http: HttpRequest, body: CompletionRequest):
        return await server.generate(http, body, "completions")

    return app


def serve(engine: Engine, config: ServerConfig, log_level: str = "info") -> None:
    """Run the server in the foreground until interrupted."""
    import uvicorn

    if not is_loopback(config.host) and config.api_key is None:
        log.warning("listening on %s without an API key: anyone who can reach it can use it", config.host)
    uvicorn.run(build_app(engine, config), host=config.host, port=config.port, log_level=log_level,
                timeout_graceful_shutdown=5)
