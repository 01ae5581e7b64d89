"""Disk tier: one safetensors file per chunk, verified before use, written atomically.

Layout on disk: rows of `keys`/`values` ([L, N, Hkv, D]) are stored in ranking order, so the tokens a
ranked selection recomputes are the first rows and the reuse complement is one contiguous tail that
can be read alone. The header carries the model fingerprint, the chunk id and a sha256 of the data
section; a file that fails any check is deleted and reported as CorruptChunkError, never used.
safetensors holds plain tensors only, so nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from cachetune.chunks.encode import ENCODING_VERSION, EncodedChunk, chunk_id
from cachetune.chunks.ranking import ranking_from_scores
from cachetune.lru import LRUDict
from cachetune.store.base import ChunkStore, CorruptChunkError, StoredChunk

FORMAT = "cachetune-chunk/3"  # /2 added the ranker name and its scores, /3 compressed rows (positions, variant)


_ID = re.compile(r"^[0-9a-f]{32}$")


def _split(blob: bytes) -> tuple[dict, bytes]:
    """(header JSON, data section) of a safetensors blob."""
    (header_len,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + header_len]), blob[8 + header_len :]


def _digest(header: dict, data: bytes) -> str:
    """sha256 over every tensor's dtype, shape and offsets plus the data section: all but the metadata."""
    layout = {name: spec for name, spec in header.items() if name != "__metadata__"}
    h = hashlib.sha256(json.dumps(layout, sort_keys=True).encode())
    h.update(data)
    return h.hexdigest()


def serialize_chunk(chunk: EncodedChunk, fingerprint: str) -> bytes:
    order = chunk.ranking
    tensors = {
        "token_ids": chunk.token_ids.to(torch.int64).contiguous(),
        "ranking": order.to(torch.int64).contiguous(),
        "scores": chunk.scores.to(torch.float32).contiguous(),
        "keys": chunk.keys.index_select(1, order).contiguous(),
        "values": chunk.values.index_select(1, order).contiguous(),
    }
    if chunk.positions is not None:
        tensors["positions"] = chunk.positions.to(torch.int64).contiguous()
    meta = {"format": FORMAT, "chunk_id": chunk.chunk_id, "fingerprint": fingerprint, "encoding": ENCODING_VERSION,
            "ranker": chunk.ranker, "variant": chunk.variant}
    # Tensor layout and data do not change when the metadata gains the checksum, so hash them first.
    digest = _digest(*_split(save(tensors, metadata=meta)))
    return save(tensors, metadata={**meta, "sha256": digest})


def _check_layout(path: Path, header: dict) -> None:
    """The tensors exist with the dtypes and mutually consistent shapes a chunk must have: R rows
    (the token count N, or the length of `positions` for compressed rows) of ranking, scores and K/V."""
    try:
        ids, ranking, scores, keys, values = (header[n] for n in ("token_ids", "ranking", "scores", "keys", "values"))
    except KeyError as exc:
        raise CorruptChunkError(f"{path}: missing tensor {exc}") from None
    positions = header.get("positions")
    rows = ids["shape"] if positions is None else positions["shape"]
    ok = (
        ids["dtype"] == ranking["dtype"] == "I64"
        and len(ids["shape"]) == 1
        and (positions is None or (positions["dtype"] == "I64" and len(rows) == 1))
        and ranking["shape"] == rows
        and scores["dtype"] == "F32"
        and scores["shape"] == rows
        and keys["shape"] == values["shape"]
        and keys["dtype"] == values["dtype"]
        and keys["dtype"] in ("F32", "BF16", "F16")
        and len(keys["shape"]) == 4
        and keys["shape"][1] == rows[0]
    )
    if not ok:
        raise CorruptChunkError(f"{path}: tensor layout is not a chunk's")


class DiskChunk(StoredChunk):
    def __init__(self, path: Path, meta: dict, token_ids: torch.Tensor, ranking: torch.Tensor, scores: torch.Tensor,
                 positions: torch.Tensor | None):
        self.path = path
        self.chunk_id = meta["chunk_id"]
        self.ranker = meta["ranker"]
        self.variant = meta["variant"]
        self.positions = positions
        self.token_ids = token_ids
        self.ranking = ranking
        self.scores = scores
        self._rank_of = torch.empty_like(ranking)
        self._rank_of[ranking] = torch.arange(ranking.numel())
        self._file = safe_open(str(path), framework="pt")

    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._rank_of[indices.cpu()]
        if rows.numel() == 0:
            lo, hi = 0, 0
        else:
            lo, hi = int(rows.min()), int(rows.max()) + 1
        # Read only the covering row range of this layer (the whole request for a ranked complement).
        k = self._file.get_slice("keys")[layer : layer + 1, lo:hi][0]
        v = self._file.get_slice("values")[layer : layer + 1, lo:hi][0]
        local = rows - lo
        return k.index_select(0, local), v.index_select(0, local)


class DiskStore(ChunkStore):
    """Chunks under `root/<fingerprint prefix>/`, so several models can share one directory.

    Verified handles (each holds its file open) are kept for the `max_open` most recently used chunks;
    a chunk past that is verified again on its next use."""

    def __init__(self, root: str | Path, fingerprint: str, max_open: int = 1024):
        self.fingerprint = fingerprint
        self.root = Path(root) / fingerprint[:16]
        self.root.mkdir(parents=True, exist_ok=True)
        self._verified: LRUDict[str, DiskChunk] = LRUDict(max_open)

    def path(self, chunk_id: str) -> Path:
        if not _ID.match(chunk_id):  # ids are content addresses; anything else could escape the folder
            raise ValueError(f"malformed chunk id {chunk_id!r}")
        return self.root / f"{chunk_id}.safetensors"

    def put(self, chunk: EncodedChunk) -> None:
        target = self.path(chunk.chunk_id)
        if target.exists():
            return
        blob = serialize_chunk(chunk, self.fingerprint)
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)  # atomic: readers see the old state or the whole new file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, chunk_id: str) -> DiskChunk | None:
        cached = self._verified.get(chunk_id)
        if cached is not None and cached.path.exists():
            return cached
        path = self.path(chunk_id)
        if not path.exists():
            return None
        try:
            stored = self._verify(path, chunk_id)
        except CorruptChunkError:
            path.unlink(missing_ok=True)
            raise
        self._verified.put(chunk_id, stored)
        return stored

    def _verify(self, path: Path, expected_id: str) -> DiskChunk:
        """Full check: header, checksum, model fingerprint, content address and tensor shapes.

        It runs on the first `get` of an id in this store instance; later gets reuse the verified
        handle (re-hashing on every request would cost more than the sparse load it precedes). A file
        rewritten behind a live store is not re-checked until the store is reopened.
        """
        blob = path.read_bytes()
        try:
            header, data = _split(blob)
            meta = header["__metadata__"]
        except Exception as exc:  # any parse failure means the file is not ours or is truncated
            raise CorruptChunkError(f"{path}: unreadable header ({exc})") from None
        if meta.get("format") != FORMAT or meta.get("encoding") != ENCODING_VERSION:
            raise CorruptChunkError(f"{path}: format {meta.get('format')!r}/{meta.get('encoding')!r} not supported")
        if meta.get("fingerprint") != self.fingerprint:
            raise CorruptChunkError(f"{path}: encoded by another model (fingerprint mismatch)")
        if _digest(header, data) != meta.get("sha256"):
            raise CorruptChunkError(f"{path}: checksum mismatch")
        _check_layout(path, header)
        with safe_open(str(path), framework="pt") as f:
            token_ids, ranking, scores = (f.get_tensor(n) for n in ("token_ids", "ranking", "scores"))
            positions = f.get_tensor("positions") if "positions" in header else None
        variant = meta.get("variant")
        if not isinstance(variant, str):
            raise CorruptChunkError(f"{path}: no variant in the metadata")
        if meta.get("chunk_id") != expected_id or chunk_id(self.fingerprint, token_ids, variant) != expected_id:
            raise CorruptChunkError(f"{path}: content does not match chunk id {expected_id}")
        if positions is not None and positions.numel() and (
            int(positions[0]) < 0 or int(positions[-1]) >= token_ids.numel() or bool((positions.diff() <= 0).any())
        ):
            raise CorruptChunkError(f"{path}: row positions are not increasing positions of the chunk's tokens")
        if not torch.equal(ranking.sort().values, torch.arange(ranking.numel())):
            raise CorruptChunkError(f"{path}: ranking is not a permutation of the chunk's tokens")
        if not torch.equal(ranking_from_scores(scores), ranking):
            raise CorruptChunkError(f"{path}: ranking does not follow the stored scores")
        if not isinstance(meta.get("ranker"), str):
            raise CorruptChunkError(f"{path}: no ranker name in the metadata")
        return DiskChunk(path, meta, token_ids, ranking, scores, positions)

    def remove(self, chunk_id: str) -> None:
        self._verified.pop(chunk_id, None)
        self.path(chunk_id).unlink(missing_ok=True)
