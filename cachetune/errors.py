"""Errors a user can act on. Every one of them is a CachetuneError, so the CLI (and later the server)
can report it in one line instead of a traceback; each also keeps the builtin base it always had."""

from __future__ import annotations


class CachetuneError(Exception):
    """Base of every error cachetune raises on purpose (bad input, refused work, corrupt data)."""


class ModelLoadError(CachetuneError, ValueError):
    """A model file or directory could not be loaded (missing, truncated or not what it claims to be)."""


class RequestError(CachetuneError, ValueError):
    """A request can never be served as given (too long for the model, larger than the KV budget...)."""
