"""The chunk blob: one chunk as bytes for every byte tier (a disk file, a Redis value), read by ranges.

A blob is a safetensors file (plain tensors only, so nothing is ever unpickled):

    token_ids [N] I64, ranking [R] I64, scores [R] F32, positions [R] I64 (compressed rows only),
    kv [L, R, 2, Hkv, D]: row i of layer l holds the pre-RoPE key and the value of local row ranking[i].

    kv_sums [L, B] I64: the xxh3_64 of every block of `block_rows` rows of every layer (range verification).

Rows are in ranking order, so for any recompute count k the reused rows of a layer are one contiguous
byte range (`BlobLayout.span`): one positioned read (disk) or one GETRANGE (Redis) per chunk per layer,
keys and values together. The metadata names the format, chunk id, model fingerprint and shape
(layers, KV heads, head size), encoding, ranker and variant, the block size and row hash, and holds a
sha256 over everything else: the whole header (metadata included) and the data. `verify` checks all of
it, the content address, and that the block sums are those of the rows.

Range verification. After that first whole read a byte tier is read by ranges, and a shared tier can
change under a live handle (a Redis value overwritten or copied from another key, a file rewritten in
place keeping its size and mtime). So every range is widened to block boundaries (`BlobLayout.covering`)
and each block is hashed and compared with the sums held in memory since the verified read
(`BlobLayout.check`): a changed block fails, and so does a block of another chunk, another layer or
another position (each block's hash is seeded with the chunk id and the block's index). The hash need
not be cryptographic: the expected values come from the sha256-verified blob, and whoever can write the
tier can already write a whole blob that verifies (the sha256 is no signature), so a keyed or
cryptographic hash would stop nobody that xxh3_64 lets through; what it must catch is accidental change,
for which 64 bits leave a 2^-64 chance per changed block. Measured: experiments/range_verification.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xxhash
from safetensors.torch import save

from cachetune.chunks.encode import ENCODING_VERSION, EncodedChunk, chunk_id
from cachetune.chunks.ranking import ranking_from_scores
from cachetune.store.base import CorruptChunkError, StoredChunk

FORMAT = "cachetune-chunk/5"  # /4 had no block sums (ranges unverified); /3 kept keys and values apart
ROW_HASH = "xxh3_64"          # the hash of a block of rows (the only one this format knows)
BLOCK_BYTES = 1 << 15         # a block holds the rows of one layer that fit in this (at least one row)
_MASK = (1 << 64) - 1
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


def block_rows_for(row_bytes: int) -> int:
    """Rows per verified block for rows of `row_bytes` (what `pack` writes)."""
    return max(1, BLOCK_BYTES // row_bytes)


def _seed(chunk_id_: str) -> int:
    """The base seed of a chunk's block hashes (block i of the blob is hashed with base + i)."""
    return int(chunk_id_[:16], 16)


def block_sums(kv: memoryview, layers: int, rows: int, row_bytes: int, block_rows: int, chunk_id_: str) -> array:
    """[layers * blocks] xxh3_64 of every block of the rows `kv` (all layers, ranking order) holds."""
    blocks = -(-rows // block_rows)
    seed, sums = _seed(chunk_id_), array("Q")
    for layer in range(layers):
        for b in range(blocks):
            start = (layer * rows + b * block_rows) * row_bytes
            end = (layer * rows + min((b + 1) * block_rows, rows)) * row_bytes
            sums.append(xxhash.xxh3_64_intdigest(kv[start:end], (seed + layer * blocks + b) & _MASK))
    return sums


@dataclass(frozen=True)
class BlobLayout:
    """Where the K/V rows of a blob lie: byte `kv_start` of the blob, `rows` R per layer; and how its
    ranges are verified: blocks of `block_rows` rows of one layer, whose xxh3_64 sums are `sums`
    ([layers * blocks], from the verified blob), hashed with seed `seed` + the block's index."""

    kv_start: int
    rows: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_rows: int = 1
    sums: array | None = field(default=None, compare=False, repr=False)
    seed: int = 0

    @property
    def row_bytes(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def blocks(self) -> int:
        """Blocks per layer."""
        return -(-self.rows // self.block_rows)

    def span(self, layer: int, lo: int, hi: int) -> tuple[int, int]:
        """(byte offset, byte length) of rank rows [lo, hi) of `layer`: one contiguous range."""
        if not (0 <= layer < self.layers and 0 <= lo <= hi <= self.rows):
            raise IndexError(f"rows [{lo}, {hi}) of layer {layer} outside [0, {self.rows}) x {self.layers} layers")
        return self.kv_start + (layer * self.rows + lo) * self.row_bytes, (hi - lo) * self.row_bytes

    def covering(self, lo: int, hi: int) -> tuple[int, int]:
        """Rows [a, b) on block boundaries holding rows [lo, hi): what is read so that [lo, hi) can
        be verified (an empty range stays empty)."""
        if not 0 <= lo <= hi <= self.rows:
            raise IndexError(f"rows [{lo}, {hi}) outside [0, {self.rows})")
        if lo == hi:
            return lo, hi
        return lo - lo % self.block_rows, min(hi + (-hi) % self.block_rows, self.rows)

    def check(self, layer: int, lo: int, hi: int, parts: Sequence) -> None:
        """Verify rows [lo, hi) of `layer` (block-aligned: `covering`), whose bytes are `parts` one
        after the other (bytes, bytearrays, memoryviews); CorruptChunkError at the first block whose
        hash is not the one verified with the whole blob."""
        if hi <= lo:
            return
        if self.sums is None:
            raise CorruptChunkError("no block sums to verify a range with")
        rb, br = self.row_bytes, self.block_rows
        if lo % br or (hi % br and hi != self.rows) or not 0 <= layer < self.layers:
            raise IndexError(f"rows [{lo}, {hi}) of layer {layer} are not whole blocks of {br} rows")
        views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
        if sum(len(v) for v in views) != (hi - lo) * rb:
            raise CorruptChunkError(f"short range: {sum(len(v) for v in views)} of {(hi - lo) * rb} bytes")
        first = layer * self.blocks
        part, at = 0, 0  # where the next block starts: views[part][at]
        for block in range(lo // br, -(-hi // br)):
            need = (min((block + 1) * br, self.rows) - block * br) * rb
            seed = (self.seed + first + block) & _MASK
            view = views[part]
            if len(view) - at >= need:  # the block lies in one part
                digest = xxhash.xxh3_64_intdigest(view[at: at + need], seed)
                at += need
            else:
                h = xxhash.xxh3_64(seed=seed)
                while need:
                    if at == len(views[part]):
                        part, at = part + 1, 0
                    take = min(need, len(views[part]) - at)
                    h.update(views[part][at: at + take])
                    at, need = at + take, need - take
                digest = h.intdigest()
            if at == len(views[part]) and part + 1 < len(views):
                part, at = part + 1, 0
            if digest != self.sums[first + block]:
                rows = f"[{block * br}, {min((block + 1) * br, self.rows)})"
                raise CorruptChunkError(f"rows {rows} of layer {layer} changed since the chunk was verified "
                                        "(block checksum mismatch)")


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
    layers, rows, kv_heads, head_dim = (int(n) for n in chunk.keys.shape)
    row_bytes = 2 * kv_heads * head_dim * chunk.keys.dtype.itemsize
    block_rows = block_rows_for(row_bytes)
    kv_bytes = memoryview(tensors["kv"].reshape(-1).view(torch.uint8).numpy()) if rows else memoryview(b"")
    sums = block_sums(kv_bytes.cast("B"), layers, rows, row_bytes, block_rows, chunk.chunk_id)
    raw = bytearray(sums.tobytes())  # the unsigned sums' bits, stored as I64
    sums_tensor = torch.frombuffer(raw, dtype=torch.int64) if raw else torch.empty(0, dtype=torch.int64)
    tensors["kv_sums"] = sums_tensor.view(layers, -(-rows // block_rows))
    meta = {"format": FORMAT, "chunk_id": chunk.chunk_id, "fingerprint": fingerprint, "encoding": ENCODING_VERSION,
            "ranker": chunk.ranker, "variant": chunk.variant,
            "shape": json.dumps([layers, kv_heads, head_dim]), "row_hash": ROW_HASH, "block_rows": str(block_rows)}
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
    for key in ("ranker", "variant", "chunk_id", "shape", "row_hash", "block_rows"):
        if key not in meta:
            raise CorruptChunkError(f"no {key} in the metadata")
    if meta["row_hash"] != ROW_HASH or not re.fullmatch(r"[1-9][0-9]{0,8}", meta["block_rows"]):
        raise CorruptChunkError(f"block sums {meta['row_hash']!r} of {meta['block_rows']!r} rows not supported")
    block_rows = int(meta["block_rows"])
    kv_dtype = header.get("kv", {}).get("dtype") if isinstance(header.get("kv"), dict) else None
    if kv_dtype not in DTYPES:
        raise CorruptChunkError(f"K/V dtype {kv_dtype!r} is not one of {sorted(DTYPES)}")
    ids_at = _spec(header, "token_ids", "I64", 1, len(data))
    rank_at = _spec(header, "ranking", "I64", 1, len(data))
    scores_at = _spec(header, "scores", "F32", 1, len(data))
    kv_shape, kv_begin, kv_end = _spec(header, "kv", kv_dtype, 5, len(data))
    sums_shape, sums_begin, sums_end = _spec(header, "kv_sums", "I64", 2, len(data))
    pos_at = _spec(header, "positions", "I64", 1, len(data)) if "positions" in header else None
    (n,), (rows,) = ids_at[0], rank_at[0]
    layers, kv_rows, two, kv_heads, head_dim = kv_shape
    if scores_at[0] != [rows] or kv_rows != rows or two != 2 or (pos_at is None and rows != n) \
            or (pos_at is not None and pos_at[0] != [rows]):
        raise CorruptChunkError("tensor shapes are not a chunk's")
    if json.dumps([layers, kv_heads, head_dim]) != meta["shape"] or (
            shape is not None and (layers, kv_heads, head_dim) != (shape.layers, shape.kv_heads, shape.head_dim)):
        raise CorruptChunkError(f"K/V shape {layers}x{kv_heads}x{head_dim} is not the model's")
    if sums_shape != [layers, -(-rows // block_rows)]:
        raise CorruptChunkError("block sums are not one per block of every layer")
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
    row_bytes = 2 * kv_heads * head_dim * DTYPES[kv_dtype].itemsize
    sums = array("Q", bytes(data[sums_begin:sums_end]))
    if sums != block_sums(memoryview(data)[kv_begin:kv_end], layers, rows, row_bytes, block_rows, expected_id):
        raise CorruptChunkError("block sums are not those of the rows")
    layout = BlobLayout(8 + header_length(blob) + kv_begin, rows, layers, kv_heads, head_dim, DTYPES[kv_dtype],
                        block_rows, sums, _seed(expected_id))
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
