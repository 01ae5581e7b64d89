"""HTTP plumbing of the server: OpenAI-style errors, the body-size guard, a background runner."""

from __future__ import annotations

import threading
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An answer with an OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413 before the app parses any of it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = ApiError(413, f"request body over the limit of {self.limit} bytes")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await too_large.response()(scope, receive, send)
        seen, over = 0, False

        async def limited():
            nonlocal seen, over
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                over = True
                raise too_large
            return message

        async def unless_over(message):  # the app's own answer to the broken read is replaced
            if not over:
                await send(message)

        try:
            await self.app(scope, limited, unless_over)
        except ApiError:
            pass
        if over:
            await too_large.response()(scope, receive, send)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "constrained-float"}


def param_path(loc) -> str:
    """A pydantic error location -> the field path a user wrote ("messages[0].role")."""
    out = ""
    for part in loc:
        if part == "body" or (isinstance(part, str) and (part in _TYPE_TAGS or part[:1].isupper() or "[" in part
                                                          or part.startswith(("literal", "constrained-",
                                                                              "function-")))):
            continue  # the union member pydantic tried ("str", "DocumentById", a literal), not a field
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")



class BackgroundServer:
    """The server on a free loopback port in a thread (tests, notebooks): `with BackgroundServer(app) as url:`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="cachetune-http", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
