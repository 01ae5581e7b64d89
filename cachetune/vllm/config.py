"""The connector's settings, the per-request parameters, and what a request must carry to be blended.

Server-wide settings come from vLLM's `kv_connector_extra_config` (`connector_config` builds the whole
`kv_transfer_config`); defaults are the standalone engine's (`EngineConfig`), so a method, ratio or
tier spec means the same in both. A request chooses through `kv_transfer_params["cachetune"]`:

    {"documents": [chunk ids]}     use these stored documents where their tokens appear in the prompt
                                   (absent: look for every document this server knows)
    {"method": "epic", "ratio": 0.3}   the selection for this request (absent: the server's)
    {"register": true}             the prompt is a document: store its KV (computed alone by vLLM)

Blended KV is approximate, and vLLM's prefix cache is exact: blocks are hashed under the prompt's
tokens, so a later plain request with the same prefix would silently read blended rows. A request is
therefore blended only when its `cache_salt` starts with BLEND_SALT (`blend_salt()` makes one; behind
`vllm serve`, `serve.BlendSalt` adds it to every request with cachetune parameters), which puts its
blocks in a hash space of their own; any other request is left to vLLM untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachetune.config import EngineConfig
from cachetune.methods import make_method
from cachetune.methods.base import check_ratio

PARAMS_KEY = "cachetune"
BLEND_SALT = "cachetune-blend:"
CONNECTOR_NAME = "CachetuneConnector"
CONNECTOR_MODULE = "cachetune.vllm.connector"
WORKER_EXTENSION = "cachetune.vllm.extension.CachetuneWorkerExtension"


def blend_salt(method: str = "", tenant: str = "") -> str:
    """A cache_salt that lets the connector blend a request: blended requests of the same method (and
    tenant) share their blocks with each other, never with exact requests."""
    return f"{BLEND_SALT}{method}:{tenant}"


def may_blend(cache_salt: str | None) -> bool:
    return isinstance(cache_salt, str) and cache_salt.startswith(BLEND_SALT)


def salt_for(kv_transfer_params: Any, cache_salt: Any) -> str | None:
    """The cache_salt a request with these parameters should carry so it may be blended: None when it
    carries no cachetune parameters (or bad ones, which the connector reports) or may be blended
    already. A tenant's own salt is kept inside the new one, so tenants stay apart."""
    if not isinstance(kv_transfer_params, dict) or may_blend(cache_salt):
        return None
    try:
        params = RequestParams.of(kv_transfer_params)
    except ValueError:
        return None
    if params is None or params.register:
        return None
    return blend_salt(params.method or "", cache_salt if isinstance(cache_salt, str) else "")


@dataclass(frozen=True)
class ConnectorSettings:
    """What `kv_connector_extra_config` may set (every field optional)."""

    method: str = EngineConfig.method     # the selection of a request that names none
    ratio: float = EngineConfig.ratio     # share of document tokens recomputed (methods with a budget)
    tiers: str = EngineConfig.tiers       # where documents are stored (config.parse_tiers)
    ranking: str = EngineConfig.ranking   # offline ranking stored with each document
    documents: int = EngineConfig.tracked_chunks  # documents the scheduler remembers for finding them
    find_documents: bool = True           # look for known documents in prompts that name none
    # Blends started per engine step (0: no limit). A blend runs inside the step, so running decodes
    # wait for every blend of that step: one per step bounds their stall to one blend's time.
    blends_per_step: int = 1
    fingerprint: str | None = None        # the model's cachetune fingerprint (None: computed from its files)
    engine: EngineConfig = field(init=False)

    def __post_init__(self) -> None:
        engine = EngineConfig(method=self.method, ratio=self.ratio, tiers=self.tiers, ranking=self.ranking,
                              tracked_chunks=self.documents)
        make_method(self.method, engine)  # an unknown method fails at start-up, not per request
        if isinstance(self.blends_per_step, bool) or not isinstance(self.blends_per_step, int) \
                or self.blends_per_step < 0:
            raise ValueError(f"blends_per_step must be an integer >= 0, got {self.blends_per_step!r}")
        object.__setattr__(self, "engine", engine)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {f for f in cls.__dataclass_fields__ if f != "engine"}
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown cachetune connector setting(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**extra)


@dataclass(frozen=True)
class RequestParams:
    """A request's `kv_transfer_params["cachetune"]`, checked."""

    documents: tuple[str, ...] | None = None
    method: str | None = None
    ratio: float | None = None
    register: bool = False

    @classmethod
    def of(cls, kv_transfer_params: dict[str, Any] | None) -> RequestParams | None:
        """None when the request carries no cachetune parameters. Raises ValueError on bad ones.

        Read from `kv_transfer_params["cachetune"]`, or, without that key, from `documents`, `method`
        and `ratio` at the top level when `documents` is there (the short form an OpenAI client sends;
        other keys belong to other connectors and are left alone)."""
        params = kv_transfer_params or {}
        raw = params.get(PARAMS_KEY)
        if raw is None:
            if "documents" not in params:
                return None
            raw = {key: params[key] for key in ("documents", "method", "ratio") if key in params}
        if not isinstance(raw, dict):
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] must be an object")
        unknown = set(raw) - {"documents", "method", "ratio", "register"}
        if unknown:
            raise ValueError(f"unknown cachetune request parameter(s) {sorted(unknown)}")
        documents = raw.get("documents")
        if documents is not None:
            if not isinstance(documents, list) or not all(isinstance(d, str) and d for d in documents):
                raise ValueError("documents must be a list of chunk ids")
            documents = tuple(documents)
        method, ratio = raw.get("method"), raw.get("ratio")
        if method is not None:
            make_method(method)
        if ratio is not None:
            check_ratio(ratio)
        register = raw.get("register", False)
        if not isinstance(register, bool):
            raise ValueError("register must be true or false")
        return cls(documents, method, ratio, register)


def check_parallelism(pipeline_parallel: int) -> None:
    """Refuse what the connector cannot serve, at start-up rather than with wrong KV: under pipeline
    parallelism a worker lacks the other stages' layers. (Tensor parallelism is served: each rank
    blends its own heads, vllm.parallel.)"""
    if pipeline_parallel != 1:
        raise ValueError(f"the cachetune connector does not serve pipeline parallelism ({pipeline_parallel} "
                         "stages asked); start vLLM with --pipeline-parallel-size 1 (tensor parallelism works)")


def connector_config(**settings: Any) -> dict[str, Any]:
    """The `kv_transfer_config` that loads this connector (`LLM(kv_transfer_config=...)` or
    `--kv-transfer-config` as JSON); `settings` are ConnectorSettings fields. A load that cannot be
    served is recomputed by vLLM, never failed."""
    ConnectorSettings.from_extra(settings)  # bad settings fail here, in the caller's process
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": settings}


def model_fingerprint_of(model_dir: str | os.PathLike[str], cache_file: Path | None = None) -> str:
    """The fingerprint the standalone engine gives the model in `model_dir` (an HF directory), so the
    connector and the engine read each other's documents. Computing it loads the model once through
    transformers; the result is kept in `cache_file` under the directory's weight files' sizes and
    modification times."""
    from cachetune.model.loader import default_cache_dir, load_model, model_fingerprint

    path = Path(model_dir).expanduser().resolve()
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json"))
    key = hashlib.sha256(json.dumps([[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]).encode()
                         + str(path).encode()).hexdigest()
    cache_file = cache_file or default_cache_dir() / "fingerprints.json"
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return known[key]
    fingerprint = model_fingerprint(load_model(path).model)
    known = known if isinstance(known, dict) else {}
    known[key] = fingerprint
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    temporary = cache_file.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(known))
    temporary.replace(cache_file)
    return fingerprint
