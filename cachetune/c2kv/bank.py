"""Trained tokens by name for one base model: the bundled trained file, untrained step-0 ones, or files.

    bank = ExtractorBank(adapter, weights_identity(model), model_fingerprint(model), eos_id)
    bank.get("bundled")              # the C2KV extractor shipped for this exact base model (c2kv/weights/)
    bank.get("paper")                # the one trained as the paper builds it (`make c2kv-paper`, built_dir())
    bank.get("step0")                # untrained: copies of the base projections, EOS embedding
    bank.get("step0+residual")       # the same, residual variant ("step0+anchor": anchored C2Tokens)
    bank.get("runs/c2kv/extractor.safetensors")
    bank.get("step0", LinkTokens)    # any TrainedTokens kind (KVLink's link tokens)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cachetune.c2kv.extractor import C2Extractor
from cachetune.c2kv.tokens import TokensFileError, TrainedTokens, read_tokens_file
from cachetune.lru import LRUDict
from cachetune.model.adapter import ModelAdapter

BUNDLED_DIR = Path(__file__).parent / "weights"


def built_dir() -> Path:
    """Where weights built on this machine live: those that only reproduce the paper's variant would
    add 33 MB each to the wheel, so a make target writes them here instead. $CACHETUNE_WEIGHTS_DIR,
    else ${XDG_CACHE_HOME:-~/.cache}/cachetune/weights."""
    if os.environ.get("CACHETUNE_WEIGHTS_DIR"):
        return Path(os.environ["CACHETUNE_WEIGHTS_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cachetune" / "weights"


# The weights a name stands for: spec -> the folder searched for this base model's file (read on use,
# so the environment is read when weights load). "bundled" ships in the package; "paper" is built.
SHIPPED = {"bundled": lambda: BUNDLED_DIR, "paper": lambda: built_dir() / "paper"}
# (spec, file kind) -> the make target that builds those weights (for SmolLM2-135M-Instruct).
BUILT_BY = {("paper", C2Extractor.FORMAT): "c2kv-paper"}


@dataclass(frozen=True)
class LoadedTokens:
    tokens: TrainedTokens
    variant: str   # what chunk ids of rows they produce derive with ("c2kv:<fingerprint>")

    @property
    def block(self) -> int:
        return self.tokens.config.block


def bundled_path(base_identity: str, kind: str, folder: Path = BUNDLED_DIR) -> Path | None:
    """The shipped file of `kind` trained for exactly this base model (any dtype), if there is one."""
    for path in sorted(folder.glob("*.safetensors")):
        try:
            meta, _ = read_tokens_file(path, kind)
        except TokensFileError:
            continue
        if meta["base"] == base_identity:
            return path
    return None


class ExtractorBank:
    """Loads trained tokens on first use and keeps the `max_loaded` most recent ones.

    `base_identity` (model.loader.weights_identity) is what files are matched against;
    `base_fingerprint` (the model in its dtype) is what chunk ids of extracted rows derive from."""

    def __init__(self, adapter: ModelAdapter, base_identity: str, base_fingerprint: str, eos_id: int,
                 max_loaded: int = 4):
        self.adapter, self.base_identity, self.base_fingerprint = adapter, base_identity, base_fingerprint
        self.eos_id = eos_id
        if isinstance(max_loaded, bool) or not isinstance(max_loaded, int) or max_loaded < 1:
            raise ValueError(f"max_loaded must be an integer >= 1, got {max_loaded!r}")
        # At most `max_loaded` weights kept (a Block-Attention fine-tune is a whole model copy); requests
        # can name only shipped, step-0 or configured weights (methods.base.check_request_method).
        self._loaded: LRUDict[tuple[str, str], LoadedTokens] = LRUDict(max_loaded)

    def get(self, spec: str, kind: type[TrainedTokens] = C2Extractor) -> LoadedTokens:
        key = (kind.FORMAT, spec)
        loaded = self._loaded.get(key)
        if loaded is None:
            tokens = self._build(spec, kind)
            tokens.eval().requires_grad_(False)
            loaded = LoadedTokens(tokens, f"{kind.VARIANT}:{tokens.fingerprint()}")
            self._loaded.put(key, loaded)
        return loaded

    def _build(self, spec: str, kind: type[TrainedTokens]) -> TrainedTokens:
        if spec in kind.STEP0:
            return kind(self.adapter, kind.STEP0[spec], self.base_identity, self.eos_id)
        if spec in SHIPPED:
            folder = SHIPPED[spec]()
            path = bundled_path(self.base_identity, kind.FORMAT, folder)
            if path is None and (spec, kind.FORMAT) in BUILT_BY:
                raise TokensFileError(
                    f"no {spec} {kind.VARIANT} weights for this model in {folder}: they are not shipped; "
                    f"`make {BUILT_BY[spec, kind.FORMAT]}` builds them for SmolLM2-135M-Instruct (about 55 min; "
                    f"CACHETUNE_WEIGHTS_DIR names another folder), or train them with `cachetune {kind.VARIANT} "
                    f"train` and pass the file as {kind.VARIANT}:<path>")
            if path is None:
                raise TokensFileError(f"no {spec} {kind.VARIANT} weights for this model; train them with "
                                      f"`cachetune {kind.VARIANT} train` and pass the file as {kind.VARIANT}:<path>")
        else:
            path = Path(spec)
            if not path.is_file():
                raise TokensFileError(f"{kind.VARIANT} weights {spec!r} are not a shipped name ({', '.join(SHIPPED)}), "
                                      f"a step-0 name ({', '.join(kind.STEP0)}) or an existing file")
        return kind.load(path, self.adapter, self.base_identity, self.eos_id)
