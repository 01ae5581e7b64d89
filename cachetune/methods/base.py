"""Methods as plug-ins: the `Method` contract, its context, and the registry every method joins.

A method decides how a request's KV cache is filled from its prompt and the chunk store (recompute
everything, reuse an exact prefix, reuse chunks and recompute some of their tokens, ...) and, when
it differs from plain causal attention, how later tokens attend. The engine knows methods only
through this file: it looks a name up in the registry, builds the method with its settings, and
calls `prepare`, `prefill` and `finish`.

    @register("epic", EpicSettings, summary="the first k tokens of every chunk")
    def _epic(settings: EpicSettings) -> Method: ...

    make_method("cachetune:probe", EngineConfig(), ratio=0.2)   # settings from the config + overrides

Every module of the `cachetune.methods` package is imported with it (its __init__), so a method
registers itself by being a module there. A module's `ORDER` says where its methods come in
`method_names()` and `--methods all` (lower first; ties by module name).
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from cachetune.c2kv.bank import SHIPPED, ExtractorBank, LoadedTokens
from cachetune.chunks.encode import EncodedChunk, chunk_id
from cachetune.chunks.rankers import Ranker
from cachetune.config import EngineConfig
from cachetune.runtime.layout import PromptLayout
from cachetune.runtime.prefill import Prefill
from cachetune.runtime.prefix_cache import PrefixCache
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.kv_cache import KVCache
from cachetune.runtime.loading import Pipeline
from cachetune.store.base import ChunkStore, CorruptChunkError, StoredChunk


class RankingSource(Protocol):
    """Offline rankings by ranker name (None: the configured default); chunks.rankings implements it."""

    def ranker(self, spec: str | None = None) -> Ranker: ...

    def scores(self, chunk: StoredChunk, spec: str | None = None) -> torch.Tensor: ...


@dataclass
class MethodContext:
    """What a method may use while it serves a request (one per engine, shared by every request)."""

    adapter: ModelAdapter
    rankings: RankingSource
    prefix_cache: PrefixCache
    pipeline: Pipeline = Pipeline()  # how reused KV is loaded (overlap, sparse reads, deferred RoPE)
    store: ChunkStore | None = None          # where derived chunk KV (C2KV rows, ...) is kept with the rest
    extractors: ExtractorBank | None = None  # trained add-ons by name (C2KV, KVLink, Block-Attention)
    # This machine's measured over predicted price of deep focus, read per request (None or a None
    # reading: not calibrated; methods.signals.PRICE_SCALE stands in)
    price_scale: Callable[[], float | None] | None = None


class Method(ABC):
    """One way to fill a request's KV cache.

    Contract:
    - `prepare(ctx, chunk)`: the untimed, offline work a cached chunk needs before this method can
      serve it (e.g. computing an offline ranking other than the stored one). Idempotent; default none.
    - `prefill(ctx, layout, capacity)`: fill rows [0, prompt_rows(layout)) of a KVCache with room for
      at least `capacity` rows and return it with the logits after the last prompt token. All of its work
      counts toward time to first token. The KV belongs to the request: the method keeps no reference.
    - decoding uses the returned Prefill's `attention` for every later token (None: causal over all
      rows, the model's own attention).
    - `finish(ctx, layout, cache)`: called once when a request served by this method ends normally,
      with its KV; default none (exact methods remember the prompt for prefix reuse).
    - `prompt_rows(layout)`: the KV rows its prefill fills (what the engine's budget reserves for the
      prompt); default one per prompt token.
    - `unavailable(ctx)`: a reason it cannot serve here (trained weights missing for this model), or
      None; `--methods all` skips such methods and says why.
    Attributes: `name` (the registered spec it was made from), `settings` (a frozen dataclass) and
    `reuses_kv`: False when its KV is the model's own (allowed even where reuse was refused).
    """

    name: str
    settings: Any
    reuses_kv: bool = True

    def prepare(self, ctx: MethodContext, chunk: StoredChunk) -> None:
        return None

    def unavailable(self, ctx: MethodContext) -> str | None:
        """Why this method cannot serve with this engine (e.g. no trained weights for its model), or None."""
        return None

    @abstractmethod
    def prefill(self, ctx: MethodContext, layout: PromptLayout, capacity: int) -> Prefill: ...

    def finish(self, ctx: MethodContext, layout: PromptLayout, cache: KVCache) -> None:
        return None

    def prompt_rows(self, layout: PromptLayout) -> int:
        return layout.total


@dataclass(frozen=True)
class NoSettings:
    """The settings of a method that has none."""


@dataclass(frozen=True)
class RatioSettings:
    ratio: float = EngineConfig.ratio  # share of chunk tokens recomputed

    def __post_init__(self) -> None:
        check_ratio(self.ratio)


# Upper bounds of method settings that size an allocation or a loop (tokens, rows, blocks, counts,
# layers): far above any real setting, low enough that a spec's number cannot make a request allocate
# or loop without end before anything else checks it.
MAX_TOKENS = 1 << 20  # a count of tokens, rows or a block size (over any context window served)
MAX_LAYERS = 1024     # a layer count or index (over any model's depth; methods clamp to the model's)
MAX_COUNT = 1024      # trained tokens per document (KVLink links)


def check_int(name: str, value, minimum: int = 1, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
            or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        text = repr(value) if not isinstance(value, int) or abs(value) < 10 ** 30 else "a larger number"
        raise ValueError(f"{name} must be an integer {bound}, got {text}")


def check_name(name: str, value) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty name or path, got {value!r}")


class TrainedMethod(Method):
    """A method that serves with trained weights from the engine's bank (C2KV, KVLink, Block-Attention).

    Subclasses set `kind` (a c2kv.tokens.TrainedFile class) and `weights_setting` (the settings field
    that names the weights: "bundled", a step-0 name or a file), and may `check` what was loaded."""

    kind: type
    weights_setting: str

    def loaded(self, ctx: MethodContext) -> LoadedTokens:
        if ctx.extractors is None or ctx.store is None:
            raise ValueError(f"{self.kind.VARIANT} needs an engine context with a chunk store and a weights bank")
        loaded = ctx.extractors.get(getattr(self.settings, self.weights_setting), self.kind)
        self.check(loaded)
        return loaded

    def check(self, loaded: LoadedTokens) -> None:
        """Raise ValueError when the loaded weights do not fit these settings."""

    def encode(self, ctx: MethodContext, loaded: LoadedTokens, chunk: StoredChunk, cid: str) -> EncodedChunk:
        """The chunk's KV as these weights derive it, stored under `cid` (methods that derive rows)."""
        raise NotImplementedError

    def rows(self, ctx: MethodContext, chunk: StoredChunk) -> StoredChunk:
        """The chunk's derived KV from the store, under an id of the chunk and the weights; encoded and
        stored first when missing, evicted or corrupt (a corrupt entry is never used)."""
        loaded = self.loaded(ctx)
        cid = chunk_id(ctx.extractors.base_fingerprint, chunk.token_ids, loaded.variant)
        try:
            stored = ctx.store.get(cid)
        except CorruptChunkError:  # the store has dropped it: encode again
            stored = None
        if stored is None:
            ctx.store.put(self.encode(ctx, loaded, chunk, cid))
            stored = ctx.store.get(cid)
        return stored

    def prepare(self, ctx: MethodContext, chunk: StoredChunk) -> None:
        self.rows(ctx, chunk)  # offline: the derived KV exists before the request's clock starts

    def unavailable(self, ctx: MethodContext) -> str | None:
        try:
            self.loaded(ctx)
        except ValueError as exc:  # TokensFileError included: missing or foreign weights
            return str(exc)
        return None


def check_ratio(ratio: float, name: str = "ratio") -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {ratio!r}")


@dataclass(frozen=True)
class Registered:
    factory: Callable[[Any], Method]  # settings -> method
    settings: type
    suffix: str | None                # settings field that "name:<value>" sets (cachetune:<ranking>)
    summary: str
    module: str                       # the module that registered it (its ORDER places it in listings)


METHODS: dict[str, Registered] = {}
# Settings whose defaults come from the engine's config.
SHARED = ("ratio", "ranking", "allocation", "signal", "deep_within")
# Method settings whose defaults come from a config field of another name (setting -> field). These are
# the settings that name trained weights ("bundled", "paper", a step-0 name or a file): a request may
# set them only to a shipped or step-0 name or the configured value (check_request_method).
CONFIG_ALIASES = {"extractor": "c2kv_extractor", "links": "kvlink_links", "weights": "block_attention_weights"}
WEIGHTS_SETTINGS = tuple(CONFIG_ALIASES)
IGNORABLE = ("ratio",)         # a request's ratio is ignored by methods without a budget (EPIC, full reuse)


def register(name: str, settings: type = NoSettings, suffix: str | None = None, summary: str = ""):
    """Decorator: register `factory(settings) -> Method` under `name` (one name, one entry)."""

    def wrap(factory):
        if name in METHODS:
            raise ValueError(f"method {name!r} is registered twice")
        METHODS[name] = Registered(factory, settings, suffix, summary, factory.__module__)
        return factory

    return wrap


def method_names() -> list[str]:
    """Every registered method name: by the `ORDER` of the module that registered it (lower first; a
    module without one, such as a plug-in registered from outside the package, after all of them),
    then by module name, then in registration order."""

    def place(item: tuple[int, str]) -> tuple[float, str, int]:
        index, name = item
        module = METHODS[name].module
        return getattr(sys.modules.get(module), "ORDER", math.inf), module, index

    return [name for _, name in sorted(enumerate(METHODS), key=place)]


def _entry(spec: str) -> tuple[str, Registered, str | None, dict[str, str]]:
    """'name[:arg][:key=value...]' -> (name, its entry, arg or None, the key=value settings)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a method is named by a non-empty string, got {spec!r}; known: {', '.join(method_names())}")
    parts = spec.split(":")
    given: dict[str, str] = {}
    while len(parts) > 1 and _SETTING.fullmatch(parts[-1]):  # trailing key=value parts set settings
        key, _, value = parts.pop().partition("=")
        given.setdefault(key, value)
    base, sep, arg = ":".join(parts).partition(":")
    entry = METHODS.get(base)
    if entry is None:
        raise ValueError(f"unknown method {spec!r}; known: {', '.join(method_names())} (and cachetune:<ranking>)")
    if sep and entry.suffix is None:
        raise ValueError(f"method {base!r} takes no ':' argument (got {spec!r})")
    return base, entry, arg if sep else None, given


_SETTING = re.compile(r"[a-z_]+=[^:=]*")
_INT = re.compile(r"-?[0-9]{1,18}")  # an integer setting's text (longer ones are no setting, only a cost)


def _parse_setting(settings: type, key: str, text: str):
    """A key=value setting from a method name, converted to its field's type."""
    types = {f.name: str(f.type) for f in dataclasses.fields(settings)}
    if key not in types:
        raise ValueError(f"no setting {key!r} (settings: {sorted(types) or 'none'})")
    kind = types[key]
    if "None" in kind and text == "none":  # an optional setting switched off ("signal_tokens=none")
        return None
    try:
        if "bool" in kind:
            if text not in ("true", "false"):
                raise ValueError
            return text == "true"
        if "int" in kind:  # plain decimal digits only: int() would also take "1_0", padding, other scripts
            if not _INT.fullmatch(text):
                raise ValueError
            return int(text)
        if "float" in kind:
            return float(text)
    except ValueError:
        raise ValueError(f"setting {key}={text!r} is not of type {kind}") from None
    return text


def make_method(spec: str, config: EngineConfig | None = None, **overrides) -> Method:
    """Build the method `spec` ("name", "name:arg", either followed by ":key=value" settings, as in
    "cachetune:first:allocation=spread") with settings taken, in order of precedence, from
    `overrides` that are not None, the settings in the name, the ":" argument, `config` (ratio,
    ranking, allocation, signal, deep_within and the trained methods' weights) and the defaults.

    An override the method has no setting for is an error, except `ratio` (methods without a budget
    ignore it, so one ratio can be passed to every method of a comparison)."""
    base, entry, arg, given = _entry(spec)
    fields = {f.name for f in dataclasses.fields(entry.settings)}
    values: dict[str, Any] = {}
    if config is not None:
        values.update({k: getattr(config, k) for k in SHARED if k in fields})
        values.update({k: getattr(config, f) for k, f in CONFIG_ALIASES.items() if k in fields})
    if arg is not None:
        values[entry.suffix] = arg
    for key, text in given.items():
        try:
            values[key] = _parse_setting(entry.settings, key, text)
        except ValueError as exc:
            raise ValueError(f"method {spec!r}: {exc}") from None
    for key, value in overrides.items():
        if value is None:
            continue
        if key in fields:
            values[key] = value
        elif key not in IGNORABLE:
            raise ValueError(f"method {base!r} has no setting {key!r} (its settings: {sorted(fields) or 'none'})")
    method = entry.factory(entry.settings(**values))
    # A ":" setting given as an override names the method as if spelled out ("cachetune:first").
    suffixed = overrides.get(entry.suffix) if entry.suffix else None
    method.name = f"{base}:{suffixed}" if suffixed is not None else spec
    return method


MAX_SPEC_CHARS = 512  # a request's method name (a long one with every setting spelled out is ~150)


def check_request_method(spec: str, config: EngineConfig) -> None:
    """Raise ValueError unless `spec` is a method a request (a server client) may name.

    A request may name any registered method with any valid settings (the same parsing and checks as
    `make_method`: an unknown method or a malformed spec fails), except that a setting that names
    trained weights (WEIGHTS_SETTINGS: C2KV's extractor, KVLink's links, Block-Attention's weights),
    set by the ':' argument or by key=value, must be a shipped name (c2kv.bank.SHIPPED), a step-0
    name of that method's weights, or exactly the value the operator configured in `config`
    (`--c2kv-extractor`, ..., or in the configured default `--method`; a file the operator chose
    included). So the weights a request can load are bounded by what the operator configured; a
    file path of the client's choosing is refused with the same message whether or not it exists.
    Nothing here touches the filesystem or loads anything. Library callers (Python API, CLI) are not
    restricted: `make_method` still takes files."""
    if isinstance(spec, str) and len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"a method name is at most {MAX_SPEC_CHARS} characters, got {len(spec)}")
    base = _entry(spec)[0]
    method = make_method(spec, config)  # builds settings only: validates every one, opens nothing
    try:  # the configured default method (`--method c2kv:<file>`) may name weights of its own too
        default = make_method(config.method, config) if _entry(config.method)[0] == base else None
    except ValueError:  # not this request's to report (the engine refuses to start with it)
        default = None
    for key in WEIGHTS_SETTINGS:
        if not hasattr(method.settings, key):
            continue
        value = getattr(method.settings, key)
        configured = {getattr(config, CONFIG_ALIASES[key]), getattr(getattr(default, "settings", None), key, None)}
        step0 = tuple(getattr(getattr(method, "kind", None), "STEP0", {}) or ())
        names = tuple(dict.fromkeys((*SHIPPED, *step0)))
        if value in names or value in configured:
            continue
        flag = "--" + CONFIG_ALIASES[key].replace("_", "-")
        raise ValueError(
            f"method {base!r}: a request may set {key} only to one of {', '.join(map(repr, names))} or to the "
            f"server's configured {key} (leave it unset: {base!r}); other weights are chosen by the server's "
            f"operator ({flag})")


def is_method(spec: str) -> bool:
    try:
        make_method(spec)
    except ValueError:
        return False
    return True


def method_settings(spec: str) -> type:
    """The settings dataclass of a registered method."""
    return _entry(spec)[1].settings


def config_settings(spec: str) -> set[str]:
    """The SHARED settings the method named `spec` takes from the engine's config: those it has and
    its name does not set ("cachetune:first" reads allocation, signal and deep_within, not ranking)."""
    base, entry, arg, given = _entry(spec)
    fields = {f.name for f in dataclasses.fields(entry.settings)}
    named = set(given) | ({entry.suffix} if arg is not None else set())
    return (fields & set(SHARED)) - named
