"""The chunk blob: one chunk as bytes for every byte tier (a disk file, a Redis value), read by ranges.

A blob is a safetensors file (plain tensors only, so nothing is ever unpickled):

    token_ids [N] I64, ranking [R] I64, scores [R] F32, positions [R] I64 (compressed rows only),
    kv [L, R, 2, Hkv, D]: row i of layer l holds the pre-RoPE key and the value of local row ranking[i].

Rows are in ranking order, so for any recompute count k the reused rows of a layer are one contiguous
byte range (`BlobLayout.rows`): one positioned read (disk) or one GETRANGE (Redis) per chunk per layer,
keys and values together. The metadata names the format, chunk id, model fingerprint and shape
(layers, KV heads, head size), encoding, ranker and variant, and holds a sha256 over everything else:
the whole header (metadata included) and the data. `verify` checks all of it and the content address.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import save

from cachetune.chunks.encode import ENCODING_VERSION, EncodedChunk, chunk_id
from cachetune.chunks.ranking import ranking_from_scores
from cachetune.store.base import CorruptChunkError, StoredChunk

FORMAT = "cachetune-chunk/4"  # /3 kept keys and values apart and left the metadata out of the checksum
MAX_HEADER = 1 << 24          # a header longer than this is not one of ours (it holds ~5 small tensors)
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ID_PATTERN = re.compile(r"[0-9a-f]{32}")


def check_id(chunk_id_: str) -> str:
    """`chunk_id_` if it is a content address (32 lowercase hex digits, nothing else); ids name
    files and keys, so anything else could escape a folder or a key space."""
    if not isinstance(chunk_id_, str) or not ID_PATTERN.fullmatch(chunk_id_):
        raise ValueError(f"malformed chunk id {chunk_id_!r}")
    return chunk_id_


@dataclass(frozen=True)
class ModelShape:
    """What every chunk of one model must match: [layers, rows, 2, kv_heads, head_dim] K/V."""

    layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class BlobLayout:
    """Where the K/V rows of a blob lie: byte `kv_start` of the blob, `rows` R per layer."""

    kv_start: int
    rows: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    def span(self, layer: int, lo: int, hi: int) -> tuple[int, int]:
        """(byte offset, byte length) of rank rows [lo, hi) of `layer`: one contiguous range."""
        if not (0 <= layer < self.layers and 0 <= lo <= hi <= self.rows):
            raise IndexError(f"rows [{lo}, {hi}) of layer {layer} outside [0, {self.rows}) x {self.layers} layers")
        return self.kv_start + (layer * self.rows + lo) * self.row_bytes, (hi - lo) * self.row_bytes


@dataclass(frozen=True)
class BlobMeta:
    """A verified blob's small part: everything but the K/V rows."""

    chunk_id: str
    token_ids: torch.Tensor       # [N]
    ranking: torch.Tensor         # [R]
    scores: torch.Tensor          # [R]
    positions: torch.Tensor | None
    ranker: str
    variant: str
    layout: BlobLayout


class BlobChunk(StoredChunk):
    """A stored chunk whose rows lie in a blob (a disk file, a Redis value) as `layout` says."""

    def __init__(self, meta: BlobMeta):
        self.layout = meta.layout
        self.take_metadata(meta)

    @property
    def num_layers(self) -> int:
        return self.layout.layers

    @property
    def row_dtype(self) -> torch.dtype:
        return self.layout.dtype


def pack(chunk: EncodedChunk, fingerprint: str) -> bytes:
    """The blob of `chunk` for the model with `fingerprint` (rows reordered by its ranking)."""
    order = chunk.ranking.to(torch.int64)
    tensors = {
        "token_ids": chunk.token_ids.to(torch.int64).contiguous(),
        "ranking": order.contiguous(),
        "scores": chunk.scores.to(torch.float32).contiguous(),
        "kv": torch.stack([chunk.keys, chunk.values], dim=2).index_select(1, order).contiguous(),
    }
    if chunk.positions is not None:
        tensors["positions"] = chunk.positions.to(torch.int64).contiguous()
    layers, _, kv_heads, head_dim = chunk.keys.shape
    meta = {"format": FORMAT, "chunk_id": chunk.chunk_id, "fingerprint": fingerprint, "encoding": ENCODING_VERSION,
            "ranker": chunk.ranker, "variant": chunk.variant,
            "shape": json.dumps([int(layers), int(kv_heads), int(head_dim)])}
    # The tensors' offsets are relative to the data section, so adding the digest moves nothing.
    header, data = split(save(tensors, metadata=meta))
    return save(tensors, metadata={**meta, "sha256": _digest(header, data)})


def header_length(prefix: bytes) -> int:
    """The header length a blob's first 8 bytes announce (bounded)."""
    if len(prefix) < 8:
        raise CorruptChunkError("truncated: no header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if not 2 <= n <= MAX_HEADER:
        raise CorruptChunkError(f"implausible header length {n}")
    return n


def parse_header(head: bytes) -> dict:
    """The header of a blob from its first 8 + header_length bytes; a clear error for anything else."""
    n = header_length(head)
    if len(head) < 8 + n:
        raise CorruptChunkError("truncated header")
    try:
        header = json.loads(head[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptChunkError(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise CorruptChunkError("header is not a table with a metadata table")
    if not all(isinstance(v, str) for v in header["__metadata__"].values()):
        raise CorruptChunkError("metadata values are not strings")
    return header


def split(blob: bytes) -> tuple[dict, bytes]:
    """(header, data section) of a whole blob."""
    header = parse_header(blob[: 8 + MAX_HEADER])
    return header, blob[8 + header_length(blob) :]


def _digest(header: dict, data: bytes) -> str:
    """sha256 over the canonical header without its own digest, then the data section."""
    meta = {k: v for k, v in header["__metadata__"].items() if k != "sha256"}
    h = hashlib.sha256(json.dumps({**header, "__metadata__": meta}, sort_keys=True).encode())
    h.update(data)
    return h.hexdigest()


def _spec(header: dict, name: str, dtype: str, ndim: int, data_len: int) -> tuple[list[int], int, int]:
    spec = header.get(name)
    ok = isinstance(spec, dict) and spec.get("dtype") == dtype and isinstance(spec.get("shape"), list) \
        and len(spec["shape"]) == ndim and all(isinstance(s, int) and s >= 0 for s in spec["shape"]) \
        and isinstance(spec.get("data_offsets"), list) and len(spec["data_offsets"]) == 2
    if not ok:
        raise CorruptChunkError(f"tensor {name!r} is missing or not {dtype} with {ndim} dims")
    begin, end = spec["data_offsets"]
    itemsize = DTYPES[dtype].itemsize if dtype in DTYPES else 8
    count = 1
    for s in spec["shape"]:
        count *= s
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_len
            and end - begin == count * itemsize):
        raise CorruptChunkError(f"tensor {name!r} has bad offsets")
    return spec["shape"], begin, end


def _tensor(data: bytes, begin: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(data[begin:end]), dtype=dtype) if end > begin else torch.empty(0, dtype=dtype)


def verify(blob: bytes, fingerprint: str, expected_id: str, shape: ModelShape | None) -> BlobMeta:
    """Check a whole blob (format, checksum, model, shape, content address, ranking) and return its
    small part; CorruptChunkError names the first thing that is wrong."""
    header, data = split(blob)
    meta = header["__metadata__"]
    if meta.get("format") != FORMAT or meta.get("encoding") != ENCODING_VERSION:
        raise CorruptChunkError(f"format {meta.get('format')!r}/{meta.get('encoding')!r} not supported")
    if meta.get("fingerprint") != fingerprint:
        raise CorruptChunkError("encoded by another model (fingerprint mismatch)")
    if _digest(header, data) != meta.get("sha256"):
        raise CorruptChunkError("checksum mismatch")
    for key in ("ranker", "variant", "chunk_id", "shape"):
        if key not in meta:
            raise CorruptChunkError(f"no {key} in the metadata")
    kv_dtype = header.get("kv", {}).get("dtype") if isinstance(header.get("kv"), dict) else None
    if kv_dtype not in DTYPES:
        raise CorruptChunkError(f"K/V dtype {kv_dtype!r} is not one of {sorted(DTYPES)}")
    ids_at = _spec(header, "token_ids", "I64", 1, len(data))
    rank_at = _spec(header, "ranking", "I64", 1, len(data))
    scores_at = _spec(header, "scores", "F32", 1, len(data))
    kv_shape, kv_begin, _ = _spec(header, "kv", kv_dtype, 5, len(data))
    pos_at = _spec(header, "positions", "I64", 1, len(data)) if "positions" in header else None
    (n,), (rows,) = ids_at[0], rank_at[0]
    layers, kv_rows, two, kv_heads, head_dim = kv_shape
    if scores_at[0] != [rows] or kv_rows != rows or two != 2 or (pos_at is None and rows != n) \
            or (pos_at is not None and pos_at[0] != [rows]):
        raise CorruptChunkError("tensor shapes are not a chunk's")
    if json.dumps([layers, kv_heads, head_dim]) != meta["shape"] or (
            shape is not None and (layers, kv_heads, head_dim) != (shape.layers, shape.kv_heads, shape.head_dim)):
        raise CorruptChunkError(f"K/V shape {layers}x{kv_heads}x{head_dim} is not the model's")
    token_ids = _tensor(data, *ids_at[1:], torch.int64)
    ranking = _tensor(data, *rank_at[1:], torch.int64)
    scores = _tensor(data, *scores_at[1:], torch.float32)
    positions = _tensor(data, *pos_at[1:], torch.int64) if pos_at is not None else None
    if meta["chunk_id"] != expected_id or chunk_id(fingerprint, token_ids, meta["variant"]) != expected_id:
        raise CorruptChunkError(f"content does not match chunk id {expected_id}")
    if positions is not None and positions.numel() and (
            int(positions[0]) < 0 or int(positions[-1]) >= n or bool((positions.diff() <= 0).any())):
        raise CorruptChunkError("row positions are not increasing positions of the chunk's tokens")
    if not torch.equal(ranking.sort().values, torch.arange(rows)):
        raise CorruptChunkError("ranking is not a permutation of the chunk's rows")
    if not torch.equal(ranking_from_scores(scores), ranking):
        raise CorruptChunkError("ranking does not follow the stored scores")
    layout = BlobLayout(8 + header_length(blob) + kv_begin, rows, layers, kv_heads, head_dim, DTYPES[kv_dtype])
    return BlobMeta(expected_id, token_ids, ranking, scores, positions, meta["ranker"], meta["variant"], layout)


SCORES_FORMAT = "cachetune-scores/1"


def pack_scores(chunk_id_: str, ranker: str, scores: torch.Tensor, fingerprint: str) -> bytes:
    """A small blob of one more ranker's scores [R] for a stored chunk (kept beside it, so another
    process never computes them again); checksummed like a chunk blob."""
    tensors = {"scores": scores.to(torch.float32).contiguous()}
    meta = {"format": SCORES_FORMAT, "chunk_id": check_id(chunk_id_), "fingerprint": fingerprint, "ranker": ranker}
    header, data = split(save(tensors, metadata=meta))
    return save(tensors, metadata={**meta, "sha256": _digest(header, data)})


def verify_scores(blob: bytes, fingerprint: str, chunk_id_: str, ranker: str, rows: int) -> torch.Tensor:
    """The scores [rows] in a blob from pack_scores, or CorruptChunkError naming what is wrong."""
    header, data = split(blob)
    meta = header["__metadata__"]
    if meta.get("format") != SCORES_FORMAT or meta.get("fingerprint") != fingerprint:
        raise CorruptChunkError("not a scores blob of this model")
    if _digest(header, data) != meta.get("sha256"):
        raise CorruptChunkError("checksum mismatch")
    if meta.get("chunk_id") != chunk_id_ or meta.get("ranker") != ranker:
        raise CorruptChunkError("scores of another chunk or ranker")
    shape, begin, end = _spec(header, "scores", "F32", 1, len(data))
    if shape != [rows]:
        raise CorruptChunkError(f"{shape[0]} scores for a chunk of {rows} rows")
    return _tensor(data, begin, end, torch.float32)
