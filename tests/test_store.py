"""Chunk stores: the in-memory LRU tier and the verified, atomically written disk tier, and what each
does when its files are damaged, swapped or attacked."""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import cachetune.store.blob as blob_module
import cachetune.store.disk as disk_module
from cachetune.chunks.encode import ENCODING_VERSION, EncodedChunk, chunk_id
from cachetune.store.base import CorruptChunkError
from cachetune.store.blob import ModelShape, pack, split, verify
from cachetune.store.disk import FORMAT, DiskStore
from cachetune.store.memory import MemoryStore
from conftest import run_in_threads

L, HKV, D = 3, 2, 8
FP = "0123456789abcdef" + "1" * 48
FP_OTHER = "fedcba9876543210" + "2" * 48


def make_chunk(n=40, seed=0, fingerprint=FP, dtype=torch.float32) -> EncodedChunk:
    gen = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, 50_000, (n,), generator=gen)
    keys = torch.randn(L, n, HKV, D, generator=gen).to(dtype)
    values = torch.randn(L, n, HKV, D, generator=gen).to(dtype)
    ranking = torch.randperm(n, generator=gen)
    return EncodedChunk(chunk_id(fingerprint, token_ids), token_ids, keys, values, ranking)


def chunk_nbytes(chunk: EncodedChunk) -> int:
    return chunk.keys.nbytes + chunk.values.nbytes


def read_header(path):
    blob = path.read_bytes()
    (header_len,) = struct.unpack("<Q", blob[:8])
    return header_len, json.loads(blob[8 : 8 + header_len])


# ======================================================================================= MemoryStore


def test_memory_store_put_get_remove() -> None:
    store = MemoryStore()
    chunk = make_chunk()
    assert store.get(chunk.chunk_id) is None
    assert chunk.chunk_id not in store
    store.put(chunk)
    stored = store.get(chunk.chunk_id)
    assert stored is not None and chunk.chunk_id in store and len(store) == 1
    assert stored.chunk_id == chunk.chunk_id
    assert torch.equal(stored.token_ids, chunk.token_ids)
    assert torch.equal(stored.ranking, chunk.ranking)
    assert stored.num_tokens == chunk.num_tokens
    idx = torch.tensor([7, 0, 39, 12])
    for layer in range(L):
        k, v = stored.load_layer(layer, idx)
        assert torch.equal(k, chunk.keys[layer][idx])
        assert torch.equal(v, chunk.values[layer][idx])
    store.remove(chunk.chunk_id)
    assert store.get(chunk.chunk_id) is None
    assert chunk.chunk_id not in store and len(store) == 0
    store.remove(chunk.chunk_id)  # removing an absent id is a no-op


def test_memory_store_load_layer_with_empty_indices_returns_empty_rows() -> None:
    store = MemoryStore()
    chunk = make_chunk()
    store.put(chunk)
    k, v = store.get(chunk.chunk_id).load_layer(1, torch.empty(0, dtype=torch.int64))
    assert k.shape == (0, HKV, D) and v.shape == (0, HKV, D)


def test_memory_store_evicts_least_recently_used_past_max_bytes() -> None:
    a, b, c = make_chunk(seed=1), make_chunk(seed=2), make_chunk(seed=3)
    store = MemoryStore(max_bytes=2 * chunk_nbytes(a))  # room for exactly two chunks
    store.put(a)
    store.put(b)
    assert store.get(a.chunk_id) is not None  # a is now the most recently used
    store.put(c)  # over budget: b, the least recently used, goes
    assert store.get(b.chunk_id) is None
    assert store.get(a.chunk_id) is not None
    assert store.get(c.chunk_id) is not None
    assert len(store) == 2


def test_memory_store_evicts_in_insertion_order_without_gets() -> None:
    chunks = [make_chunk(seed=s) for s in range(5)]
    store = MemoryStore(max_bytes=3 * chunk_nbytes(chunks[0]))
    for ch in chunks:
        store.put(ch)
    kept = [store.get(ch.chunk_id) is not None for ch in chunks]
    assert kept == [False, False, True, True, True]


def test_memory_store_put_of_present_id_is_a_no_op_that_refreshes_recency() -> None:
    a, b, c = make_chunk(seed=1), make_chunk(seed=2), make_chunk(seed=3)
    store = MemoryStore(max_bytes=2 * chunk_nbytes(a))
    store.put(a)
    store.put(b)
    store.put(a)  # not counted twice, and a becomes most recent
    assert len(store) == 2
    store.put(c)
    assert store.get(b.chunk_id) is None
    assert store.get(a.chunk_id) is not None and store.get(c.chunk_id) is not None


def test_memory_store_does_not_keep_a_chunk_larger_than_the_whole_tier() -> None:
    a, b = make_chunk(seed=1), make_chunk(seed=2, n=200)
    store = MemoryStore(max_bytes=chunk_nbytes(a))
    store.put(a)
    store.put(b)  # could never fit: nothing is evicted for it, and it is not kept
    assert store.get(b.chunk_id) is None
    assert store.get(a.chunk_id) is not None and store.nbytes <= store.max_bytes


def test_an_evicted_chunk_still_being_read_keeps_its_rows() -> None:
    a, b = make_chunk(seed=1), make_chunk(seed=2)
    store = MemoryStore(max_bytes=chunk_nbytes(a))  # room for one
    store.put(a)
    held = store.get(a.chunk_id)  # a request is reading it
    store.put(b)  # evicts a, but its rows are still in use: b cannot take them
    k, v = held.load_layer(1, torch.arange(a.num_tokens))
    assert torch.equal(k, a.keys[1]) and torch.equal(v, a.values[1])
    assert store.get(a.chunk_id) is None
    del held, k, v  # the request ends: the rows are free again
    store.put(b)
    got = store.get(b.chunk_id)
    assert got is not None and torch.equal(got.load_layer(0, torch.arange(b.num_tokens))[0], b.keys[0])


def test_memory_store_remove_frees_budget() -> None:
    a, b, c = make_chunk(seed=1), make_chunk(seed=2), make_chunk(seed=3)
    store = MemoryStore(max_bytes=2 * chunk_nbytes(a))
    store.put(a)
    store.put(b)
    store.remove(a.chunk_id)
    store.put(c)
    assert store.get(b.chunk_id) is not None and store.get(c.chunk_id) is not None


# ========================================================================================= DiskStore


def index_sets(chunk: EncodedChunk, seed=0):
    n = chunk.num_tokens
    gen = torch.Generator().manual_seed(seed)
    return {
        "random_subset_unsorted": torch.randperm(n, generator=gen)[: n // 3],
        "random_subset_sorted": torch.sort(torch.randperm(n, generator=gen)[: n // 2]).values,
        "ranking_tail": chunk.ranking[6:],  # the reuse complement of a ranked selection
        "ranking_tail_sorted": torch.sort(chunk.ranking[6:]).values,
        "ranking_head": chunk.ranking[:6],
        "all_in_token_order": torch.arange(n),
        "single": torch.tensor([n - 1]),
        "repeated": torch.tensor([3, 3, 0, 3]),
        "empty": torch.empty(0, dtype=torch.int64),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_disk_round_trip_load_layer_returns_exactly_the_in_memory_rows(tmp_path, dtype) -> None:
    chunk = make_chunk(dtype=dtype)
    DiskStore(tmp_path, FP).put(chunk)
    stored = DiskStore(tmp_path, FP).get(chunk.chunk_id)  # fresh instance: read back from the file
    assert stored is not None
    assert stored.chunk_id == chunk.chunk_id
    assert torch.equal(stored.token_ids, chunk.token_ids)
    assert torch.equal(stored.ranking, chunk.ranking)
    assert stored.num_tokens == chunk.num_tokens
    for name, idx in index_sets(chunk).items():
        for layer in range(L):
            k, v = stored.load_layer(layer, idx)
            assert k.dtype == dtype and v.dtype == dtype, name
            assert k.shape == (idx.numel(), HKV, D), name
            assert torch.equal(k, chunk.keys[layer][idx]), (name, layer)
            assert torch.equal(v, chunk.values[layer][idx]), (name, layer)


def test_disk_round_trip_through_the_writing_instance(tmp_path) -> None:
    chunk = make_chunk(seed=5)
    store = DiskStore(tmp_path, FP)
    store.put(chunk)
    stored = store.get(chunk.chunk_id)
    idx = chunk.ranking[10:]
    k, v = stored.load_layer(2, idx)
    assert torch.equal(k, chunk.keys[2][idx]) and torch.equal(v, chunk.values[2][idx])


def test_disk_store_get_unknown_is_none_and_remove_deletes(tmp_path) -> None:
    store = DiskStore(tmp_path, FP)
    chunk = make_chunk()
    assert store.get(chunk.chunk_id) is None
    assert chunk.chunk_id not in store
    store.put(chunk)
    assert chunk.chunk_id in store
    store.remove(chunk.chunk_id)
    assert not store.path(chunk.chunk_id).exists()
    assert store.get(chunk.chunk_id) is None
    assert chunk.chunk_id not in store
    store.remove(chunk.chunk_id)  # absent: no-op


def test_disk_put_writes_atomically_and_leaves_no_temp_file(tmp_path) -> None:
    store = DiskStore(tmp_path, FP)
    chunk = make_chunk()
    store.put(chunk)
    path = store.path(chunk.chunk_id)
    assert path.exists()
    assert list(store.root.glob("*.tmp")) == []
    assert [p.name for p in store.root.iterdir()] == [path.name]
    # The file is complete: every tensor parses with its full shape.
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == {"token_ids", "ranking", "scores", "kv", "kv_sums"}
        assert f.get_tensor("kv").shape == (L, chunk.num_tokens, 2, HKV, D)
        assert f.get_tensor("token_ids").shape == (chunk.num_tokens,)


def test_disk_put_that_fails_before_rename_leaves_neither_temp_nor_target(tmp_path, monkeypatch) -> None:
    store = DiskStore(tmp_path, FP)
    chunk = make_chunk()

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(disk_module.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        store.put(chunk)
    assert list(store.root.iterdir()) == []


def test_disk_put_of_present_id_is_a_no_op(tmp_path) -> None:
    store = DiskStore(tmp_path, FP)
    chunk = make_chunk()
    store.put(chunk)
    before = store.path(chunk.chunk_id).read_bytes()
    same_id_other_data = EncodedChunk(
        chunk.chunk_id, chunk.token_ids, chunk.keys + 1.0, chunk.values + 1.0, chunk.ranking
    )
    store.put(same_id_other_data)
    assert store.path(chunk.chunk_id).read_bytes() == before


def test_disk_file_is_safetensors_not_pickle(tmp_path) -> None:
    store = DiskStore(tmp_path, FP)
    chunk = make_chunk()
    store.put(chunk)
    path = store.path(chunk.chunk_id)
    blob = path.read_bytes()
    assert not blob.startswith(b"\x80") and not blob.startswith(b"PK")  # neither pickle nor torch zip
    header_len, header = read_header(path)  # 8-byte little-endian length, then JSON
    assert 8 + header_len < len(blob)
    meta = header["__metadata__"]
    assert meta["format"] == FORMAT
    assert meta["chunk_id"] == chunk.chunk_id
    assert meta["fingerprint"] == FP
    assert meta["encoding"] == ENCODING_VERSION
    assert len(meta["sha256"]) == 64
    assert header["kv"]["dtype"] == "F32" and header["kv"]["shape"] == [L, chunk.num_tokens, 2, HKV, D]
    assert header["token_ids"]["dtype"] == "I64"
    data_end = max(entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__")
    assert 8 + header_len + data_end == len(blob)


def test_disk_rows_are_stored_in_ranking_order(tmp_path) -> None:
    # Layout contract: the reuse complement (a ranking tail) is one contiguous range of rows, keys
    # and values of a row side by side.
    store = DiskStore(tmp_path, FP)
    chunk = make_chunk()
    store.put(chunk)
    with safe_open(str(store.path(chunk.chunk_id)), framework="pt") as f:
        kv = f.get_tensor("kv")
    assert torch.equal(kv[:, :, 0], chunk.keys[:, chunk.ranking])
    assert torch.equal(kv[:, :, 1], chunk.values[:, chunk.ranking])


def test_second_disk_store_instance_reads_what_the_first_wrote(tmp_path) -> None:
    first, second = DiskStore(tmp_path, FP), DiskStore(tmp_path, FP)
    chunks = [make_chunk(seed=s) for s in range(3)]
    for ch in chunks:
        first.put(ch)
    for ch in chunks:
        assert ch.chunk_id in second
        k, v = second.get(ch.chunk_id).load_layer(0, ch.ranking[5:])
        assert torch.equal(k, ch.keys[0][ch.ranking[5:]])
        assert torch.equal(v, ch.values[0][ch.ranking[5:]])


def test_disk_stores_of_different_models_share_a_root_without_clashing(tmp_path) -> None:
    a, b = DiskStore(tmp_path, FP), DiskStore(tmp_path, FP_OTHER)
    assert a.root != b.root
    ca, cb = make_chunk(seed=1, fingerprint=FP), make_chunk(seed=1, fingerprint=FP_OTHER)  # same tokens
    assert ca.chunk_id != cb.chunk_id
    a.put(ca)
    b.put(cb)
    assert ca.chunk_id in a and cb.chunk_id in b
    assert ca.chunk_id not in b and cb.chunk_id not in a


# --- corruption --------------------------------------------------------------------------------------


def write_and_locate(tmp_path, chunk=None):
    chunk = chunk or make_chunk()
    DiskStore(tmp_path, FP).put(chunk)
    return chunk, DiskStore(tmp_path, FP).path(chunk.chunk_id)


def assert_corrupt_and_dropped(store, cid, path) -> None:
    with pytest.raises(CorruptChunkError):
        store.get(cid)
    assert not path.exists(), "a corrupt file must be deleted"
    assert store.get(cid) is None  # afterwards it is simply missing
    assert cid not in store


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_disk_flipped_byte_in_data_section_raises_corrupt_and_deletes_file(tmp_path, where) -> None:
    chunk, path = write_and_locate(tmp_path)
    blob = bytearray(path.read_bytes())
    header_len, _ = read_header(path)
    start = 8 + header_len
    offset = {"first": start, "middle": (start + len(blob)) // 2, "last": len(blob) - 1}[where]
    blob[offset] ^= 0x01
    path.write_bytes(bytes(blob))
    assert_corrupt_and_dropped(DiskStore(tmp_path, FP), chunk.chunk_id, path)


@pytest.mark.parametrize("keep", ["nothing", "4_bytes", "length_only", "half_header", "header_only", "minus_one"])
def test_disk_truncated_file_raises_corrupt(tmp_path, keep) -> None:
    chunk, path = write_and_locate(tmp_path)
    blob = path.read_bytes()
    header_len, _ = read_header(path)
    size = {
        "nothing": 0,
        "4_bytes": 4,
        "length_only": 8,
        "half_header": 8 + header_len // 2,
        "header_only": 8 + header_len,
        "minus_one": len(blob) - 1,
    }[keep]
    path.write_bytes(blob[:size])
    assert_corrupt_and_dropped(DiskStore(tmp_path, FP), chunk.chunk_id, path)


def test_disk_garbage_file_raises_corrupt(tmp_path) -> None:
    chunk, path = write_and_locate(tmp_path)
    path.write_bytes(b"\xff" * 8 + b"not a safetensors file")
    assert_corrupt_and_dropped(DiskStore(tmp_path, FP), chunk.chunk_id, path)


def test_disk_file_of_another_model_raises_corrupt(tmp_path) -> None:
    chunk, path = write_and_locate(tmp_path)
    other = DiskStore(tmp_path, FP_OTHER)
    planted = other.path(chunk.chunk_id)
    shutil.copyfile(path, planted)
    assert_corrupt_and_dropped(other, chunk.chunk_id, planted)
    # The original under its own model is untouched and still valid.
    assert path.exists()
    assert chunk.chunk_id in DiskStore(tmp_path, FP)


def test_disk_file_whose_token_ids_do_not_match_its_id_raises_corrupt(tmp_path) -> None:
    good = make_chunk(seed=1)
    wrong_tokens = good.token_ids.clone()
    wrong_tokens[0] += 1
    mislabelled = EncodedChunk(good.chunk_id, wrong_tokens, good.keys, good.values, good.ranking)
    store = DiskStore(tmp_path, FP)
    store.put(mislabelled)  # checksum and fingerprint are valid; only the content address is wrong
    assert_corrupt_and_dropped(DiskStore(tmp_path, FP), good.chunk_id, store.path(good.chunk_id))


def test_disk_file_renamed_to_another_id_raises_corrupt(tmp_path) -> None:
    chunk, path = write_and_locate(tmp_path)
    store = DiskStore(tmp_path, FP)
    other_id = chunk_id(FP, torch.tensor([1, 2, 3]))
    shutil.copyfile(path, store.path(other_id))
    assert_corrupt_and_dropped(store, other_id, store.path(other_id))
    assert chunk.chunk_id in store


def test_disk_contains_is_false_for_missing_and_corrupt_and_true_for_valid(tmp_path) -> None:
    good, bad = make_chunk(seed=1), make_chunk(seed=2)
    store = DiskStore(tmp_path, FP)
    store.put(good)
    store.put(bad)
    path = store.path(bad.chunk_id)
    path.write_bytes(path.read_bytes()[:-10])
    fresh = DiskStore(tmp_path, FP)
    assert good.chunk_id in fresh
    assert bad.chunk_id not in fresh  # does not raise
    assert not path.exists()
    assert chunk_id(FP, torch.tensor([42])) not in fresh


def test_disk_store_recovers_after_corruption_by_re_put(tmp_path) -> None:
    chunk, path = write_and_locate(tmp_path)
    path.write_bytes(path.read_bytes()[:100])
    store = DiskStore(tmp_path, FP)
    with pytest.raises(CorruptChunkError):
        store.get(chunk.chunk_id)
    store.put(chunk)  # the caller re-encodes and stores again
    k, _ = store.get(chunk.chunk_id).load_layer(0, torch.arange(chunk.num_tokens))
    assert torch.equal(k, chunk.keys[0])


def test_disk_flipped_dtype_byte_in_header_raises_corrupt(tmp_path) -> None:
    chunk, path = write_and_locate(tmp_path)
    blob = bytearray(path.read_bytes())
    header_len, _ = read_header(path)
    header = blob[8 : 8 + header_len].decode()
    marker = '"kv":{"dtype":"F32"'
    pos = 8 + header.index(marker) + len(marker) - 4  # the 'F' of F32"
    assert blob[pos : pos + 3] == b"F32"
    blob[pos] = ord("I")  # still valid JSON and a valid safetensors file (I32 has the same size)
    path.write_bytes(bytes(blob))
    store = DiskStore(tmp_path, FP)
    try:
        stored = store.get(chunk.chunk_id)
    except CorruptChunkError:
        assert not path.exists()
        return
    k, _ = stored.load_layer(0, torch.arange(chunk.num_tokens))
    assert k.dtype == chunk.keys.dtype and torch.equal(k, chunk.keys[0]), "unverified data was returned"


def test_disk_round_trip_keeps_the_ranker_name_and_scores(tmp_path) -> None:
    base = make_chunk(seed=5)
    scores = torch.linspace(1.0, 0.0, base.num_tokens)[torch.randperm(base.num_tokens)]
    chunk = EncodedChunk(base.chunk_id, base.token_ids, base.keys, base.values,
                         torch.sort(scores, descending=True, stable=True).indices, scores, "probe")
    DiskStore(tmp_path, FP).put(chunk)
    stored = DiskStore(tmp_path, FP).get(chunk.chunk_id)
    assert stored.ranker == "probe"
    assert torch.equal(stored.scores, scores) and torch.equal(stored.ranking, chunk.ranking)


def test_disk_file_whose_ranking_does_not_follow_its_scores_raises_corrupt(tmp_path) -> None:
    base = make_chunk(seed=6)
    swapped = base.ranking.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # still a permutation, but not the scores' order
    forged = EncodedChunk(base.chunk_id, base.token_ids, base.keys, base.values, swapped, base.scores, "lf")
    store = DiskStore(tmp_path, FP)
    store.put(forged)
    assert_corrupt_and_dropped(DiskStore(tmp_path, FP), base.chunk_id, store.path(base.chunk_id))


def test_disk_file_of_the_previous_format_is_dropped_not_used(tmp_path) -> None:
    chunk, path = write_and_locate(tmp_path)
    blob = path.read_bytes()
    old = blob.replace(FORMAT.encode(), b"cachetune-chunk/1")
    assert old != blob
    path.write_bytes(old)
    assert_corrupt_and_dropped(DiskStore(tmp_path, FP), chunk.chunk_id, path)


# --- a store under attack, or under a crash ----------------------------------------------------------


def test_a_file_truncated_under_a_live_store_is_an_error_never_a_crash_or_stale_rows(tmp_path) -> None:
    chunk, path = write_and_locate(tmp_path)
    store = DiskStore(tmp_path, FP)
    stored = store.get(chunk.chunk_id)
    with open(path, "r+b") as f:  # in place, the same inode: a mapping would die with SIGBUS here
        f.truncate(200)
    with pytest.raises(CorruptChunkError, match="truncated"):
        stored.load_layer(L - 1, torch.arange(chunk.num_tokens))
    assert_corrupt_and_dropped(store, chunk.chunk_id, path)  # the next get sees the change


def test_a_file_rewritten_in_place_is_verified_again_and_dropped(tmp_path) -> None:
    chunk, path = write_and_locate(tmp_path)
    store = DiskStore(tmp_path, FP)
    assert store.get(chunk.chunk_id) is not None
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x01  # same size, other rows
    with open(path, "r+b") as f:
        f.write(blob)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # however coarse the clock
    assert_corrupt_and_dropped(store, chunk.chunk_id, path)


def test_temp_files_of_a_writer_killed_mid_write_are_removed_by_the_next_store(tmp_path) -> None:
    # A real writer process, killed (SIGKILL) after writing its temp file and before the rename.
    code = (
        "import os, signal, sys, torch\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "import cachetune.store.disk as disk\n"
        "from test_store import make_chunk, FP\n"
        "disk.os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)\n"
        "disk.DiskStore(sys.argv[1], FP).put(make_chunk(n=4000))\n"
    )
    folder = tmp_path / FP[:16]
    seen = []
    for _ in range(2):  # the second writer's store removes the first one's leftovers as it opens
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(Path(__file__).parent)],
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert proc.returncode == -signal.SIGKILL
        left = list(folder.glob("*.tmp"))
        assert len(left) == 1 and left[0] not in seen and left[0].stat().st_size > 4000 * 2 * L * HKV * D * 4
        seen += left
    live = folder / f"{'a' * 32}.{os.getpid()}.1.tmp"  # a writer of this very process is alive
    live.write_bytes(b"partial")
    store = DiskStore(tmp_path, FP)
    assert store.removed_temp_files == 1
    assert list(folder.glob("*.tmp")) == [live]


def test_the_checksum_covers_the_metadata(tmp_path) -> None:
    chunk, path = write_and_locate(tmp_path)
    blob = path.read_bytes()
    forged = blob.replace(b'"ranker":"lf"', b'"ranker":"lg"')
    assert forged != blob
    path.write_bytes(forged)
    assert_corrupt_and_dropped(DiskStore(tmp_path, FP), chunk.chunk_id, path)


@pytest.mark.parametrize("metadata", ['[1, 2]', '"text"', '{"format": 4}', 'null'])
def test_a_header_whose_metadata_is_not_a_table_of_strings_is_corrupt(tmp_path, metadata) -> None:
    chunk, path = write_and_locate(tmp_path)
    header = json.dumps({"__metadata__": json.loads(metadata)}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    assert_corrupt_and_dropped(DiskStore(tmp_path, FP), chunk.chunk_id, path)


@pytest.mark.parametrize("how", ["fifo", "symlink_to_fifo", "symlink_to_valid_file", "directory"])
def test_a_chunk_path_that_is_not_a_regular_file_is_refused_without_hanging(tmp_path, how) -> None:
    chunk = make_chunk()
    store = DiskStore(tmp_path / "store", FP)
    path = store.path(chunk.chunk_id)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "symlink_to_fifo":
        os.mkfifo(tmp_path / "fifo")
        path.symlink_to(tmp_path / "fifo")
    elif how == "symlink_to_valid_file":
        DiskStore(tmp_path / "elsewhere", FP).put(chunk)
        path.symlink_to(DiskStore(tmp_path / "elsewhere", FP).path(chunk.chunk_id))
    else:
        path.mkdir()
    outcome: list = []
    worker = threading.Thread(target=lambda: outcome.append(_get_outcome(store, chunk.chunk_id)), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert outcome == ["corrupt"], "get() hung or returned data" if not outcome else outcome


def _get_outcome(store, cid):
    try:
        return store.get(cid)
    except CorruptChunkError:
        return "corrupt"


def test_a_file_of_another_model_shape_under_the_same_fingerprint_is_corrupt(tmp_path) -> None:
    chunk, path = write_and_locate(tmp_path)
    assert chunk.chunk_id in DiskStore(tmp_path, FP, shape=ModelShape(L, HKV, D))
    for shape in (ModelShape(L + 1, HKV, D), ModelShape(L, HKV * 2, D), ModelShape(L, HKV, D // 2)):
        with pytest.raises(CorruptChunkError, match="not the model's"):
            DiskStore(tmp_path, FP, shape=shape).get(chunk.chunk_id)
        DiskStore(tmp_path, FP).put(chunk)


@pytest.mark.parametrize("bad", ["a" * 32 + "\n", "A" * 32, "a" * 31, "../" + "a" * 29, "a" * 33, 7])
def test_malformed_chunk_ids_never_name_a_path(tmp_path, bad) -> None:
    with pytest.raises(ValueError, match="malformed chunk id"):
        DiskStore(tmp_path, FP).path(bad)


def test_verified_disk_chunks_hold_no_memory_mappings(tmp_path) -> None:
    store = DiskStore(tmp_path, FP)
    chunks = [make_chunk(n=16, seed=s) for s in range(40)]
    for ch in chunks:
        store.put(ch)
    held = [store.get(ch.chunk_id) for ch in chunks]
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    assert str(store.root) not in maps
    assert all(torch.equal(h.load_layer(0, ch.ranking)[0], ch.keys[0][ch.ranking]) for h, ch in zip(held, chunks))


def test_the_memory_budget_holds_under_threads() -> None:
    chunks = [make_chunk(n=20, seed=s) for s in range(24)]
    budget = 3 * chunk_nbytes(chunks[0]) + 100
    store = MemoryStore(max_bytes=budget)
    peak, errors = [0], []

    def worker(offset: int) -> None:
        try:
            for i in range(300):
                ch = chunks[(offset + i) % len(chunks)]
                store.put(ch)
                peak[0] = max(peak[0], store.nbytes)
                got = store.get(chunks[(offset + 2 * i) % len(chunks)].chunk_id)
                if got is not None:
                    got.load_layer(0, torch.tensor([0]))
                if i % 7 == 0:
                    store.remove(ch.chunk_id)
        except Exception as exc:  # noqa: BLE001 - any exception is the failure under test
            errors.append(exc)

    run_in_threads(worker, [t * 5 for t in range(4)])
    assert errors == [] and peak[0] <= budget and store.nbytes <= budget


def test_the_default_memory_store_has_a_budget() -> None:
    from cachetune.config import EngineConfig, parse_tiers

    assert MemoryStore().max_bytes == parse_tiers(EngineConfig.tiers)[0].max_bytes
    with pytest.raises(ValueError, match="max_bytes"):
        MemoryStore(max_bytes=None)


# --- range verification: every range read after the first whole read is checked by block sums --------


def kv_region(blob: bytes) -> tuple[int, int]:
    """Byte [start, end) of the K/V rows [L, R, 2, Hkv, D] (ranking order) in a chunk blob."""
    (n,) = struct.unpack("<Q", blob[:8])
    begin, end = json.loads(blob[8: 8 + n])["kv"]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def format_sha256(header: dict, data: bytes) -> str:
    """The checksum a chunk blob's metadata carries, as the format defines it (what a writer, here a
    forger, must compute): sha256 of the header as sorted-key JSON without its own "sha256", then the
    data section."""
    import hashlib

    meta = {k: v for k, v in header["__metadata__"].items() if k != "sha256"}
    digest = hashlib.sha256(json.dumps({**header, "__metadata__": meta}, sort_keys=True).encode())
    digest.update(data)
    return digest.hexdigest()


def test_the_checksum_a_blob_carries_is_the_formats_sha256() -> None:
    # Guard for the forgers below: a blob's own checksum is what format_sha256 computes.
    header, data = split(pack(make_chunk(seed=30), FP))
    assert header["__metadata__"]["sha256"] == format_sha256(header, data)


def pack_previous_format(chunk: EncodedChunk, fingerprint: str) -> bytes:
    """A chunk blob exactly as format cachetune-chunk/4 wrote it (no block sums; its own sha256)."""
    from safetensors.torch import save

    order = chunk.ranking.to(torch.int64)
    tensors = {"token_ids": chunk.token_ids.to(torch.int64).contiguous(), "ranking": order.contiguous(),
               "scores": chunk.scores.to(torch.float32).contiguous(),
               "kv": torch.stack([chunk.keys, chunk.values], dim=2).index_select(1, order).contiguous()}
    layers, _, kv_heads, head_dim = chunk.keys.shape
    meta = {"format": "cachetune-chunk/4", "chunk_id": chunk.chunk_id, "fingerprint": fingerprint,
            "encoding": ENCODING_VERSION, "ranker": chunk.ranker, "variant": chunk.variant,
            "shape": json.dumps([int(layers), int(kv_heads), int(head_dim)])}
    header, data = split(save(tensors, metadata=meta))
    return save(tensors, metadata={**meta, "sha256": format_sha256(header, data)})


def load_tensors(blob: bytes) -> dict:
    from safetensors.torch import load

    return load(blob)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 7 rows for the test chunks (128-byte rows): a 40-row chunk has 6 blocks, the last of 5."""
    monkeypatch.setattr(blob_module, "BLOCK_BYTES", 7 * 2 * HKV * D * 4)
    return 7


def test_blob_block_sums_are_in_the_checksummed_blob_and_checked_at_first_read(small_blocks) -> None:
    chunk = make_chunk(n=40, seed=21)
    blob = pack(chunk, FP)
    lay = verify(blob, FP, chunk.chunk_id, None).layout
    assert lay.block_rows == 7 and lay.blocks == 6 and len(lay.sums) == L * 6
    assert load_tensors(blob)["kv_sums"].shape == (L, 6)
    # The sums must be those of the rows even when the sha256 is recomputed to match (a buggy writer):
    header, data = split(blob)
    start = header["kv_sums"]["data_offsets"][0]
    forged_data = bytearray(data)
    forged_data[start] ^= 0x01
    meta = {k: v for k, v in header["__metadata__"].items() if k != "sha256"}
    forged_header = {**header, "__metadata__": {**meta, "sha256": format_sha256(header, bytes(forged_data))}}
    raw = json.dumps(forged_header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with pytest.raises(CorruptChunkError, match="block sums are not those of the rows"):
        verify(struct.pack("<Q", len(raw)) + raw + bytes(forged_data), FP, chunk.chunk_id, None)


def test_a_range_with_one_flipped_byte_in_any_block_raises(small_blocks) -> None:
    chunk = make_chunk(n=40, seed=22)
    blob = pack(chunk, FP)
    lay = verify(blob, FP, chunk.chunk_id, None).layout
    rb, rows = lay.row_bytes, lay.rows
    gen = torch.Generator().manual_seed(0)
    for layer in range(L):
        whole_offset, whole_length = lay.span(layer, 0, rows)
        lay.check(layer, 0, rows, [blob[whole_offset: whole_offset + whole_length]])  # intact: passes
        for block in range(lay.blocks):
            a, b = block * 7, min(block * 7 + 7, rows)
            at = int(torch.randint(a * rb, b * rb, (1,), generator=gen))  # one byte anywhere in the block
            tampered = bytearray(blob)
            tampered[whole_offset + at] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
            for lo, hi in ((a, b), (0, rows), lay.covering(max(a - 1, 0), b)):  # the block, alone or among others
                offset, length = lay.span(layer, lo, hi)
                with pytest.raises(CorruptChunkError, match=f"layer {layer} changed"):
                    lay.check(layer, lo, hi, [tampered[offset: offset + length]])
                # split in parts anywhere, as a disk read into side buffers is:
                cut = offset + (length // 3)
                with pytest.raises(CorruptChunkError):
                    lay.check(layer, lo, hi, [tampered[offset:cut], memoryview(tampered)[cut: offset + length]])
            if block + 1 < lay.blocks:  # the blocks around it are still fine
                offset, length = lay.span(layer, b, rows)
                lay.check(layer, b, rows, [tampered[offset: offset + length]])


def test_a_range_of_another_chunk_another_layer_or_another_block_fails(small_blocks) -> None:
    a, b = make_chunk(n=40, seed=23), make_chunk(n=40, seed=24)
    blob_a, blob_b = pack(a, FP), pack(b, FP)
    lay = verify(blob_a, FP, a.chunk_id, None).layout
    assert len(blob_a) == len(blob_b)
    offset, length = lay.span(1, 7, 14)
    with pytest.raises(CorruptChunkError):  # the same bytes of another chunk's blob
        lay.check(1, 7, 14, [blob_b[offset: offset + length]])
    with pytest.raises(CorruptChunkError):  # this chunk's block 1 of layer 1, checked as layer 2's
        lay.check(2, 7, 14, [blob_a[offset: offset + length]])
    with pytest.raises(CorruptChunkError):  # ... as block 2 of layer 1
        lay.check(1, 14, 21, [blob_a[offset: offset + length]])
    zeros = EncodedChunk(a.chunk_id, a.token_ids, torch.zeros_like(a.keys), torch.zeros_like(a.values), a.ranking)
    zlay = verify(pack(zeros, FP), FP, a.chunk_id, None).layout
    assert len(set(zlay.sums)) == len(zlay.sums)  # identical blocks, different sums: each is bound to its place


def test_widened_reads_return_exactly_the_requested_rows(tmp_path, small_blocks) -> None:
    chunks = [make_chunk(n=40, seed=25), make_chunk(n=17, seed=26, dtype=torch.bfloat16)]
    store = DiskStore(tmp_path, FP)
    for ch in chunks:
        store.put(ch)
    fresh = DiskStore(tmp_path, FP)
    for ch in chunks:
        stored = fresh.get(ch.chunk_id)
        kv = torch.stack([ch.keys, ch.values], dim=2)[:, ch.ranking]  # [L, R, 2, Hkv, D], ranking order
        n = ch.num_tokens
        for layer in range(L):
            for lo in range(n + 1):
                for hi in range(lo, n + 1):
                    assert torch.equal(stored.read_rows(layer, lo, hi), kv[layer, lo:hi]), (layer, lo, hi)
    # several chunks and ranges in one plan land one after the other in the buffer
    a, b = (fresh.get(ch.chunk_id) for ch in chunks[:1] * 2)
    spans = [(a, 3, 40), (b, 8, 9), (a, 0, 0), (a, 13, 22)]
    out = torch.empty(37 + 1 + 9, 2, HKV, D)
    fresh.reader.plan(spans)(2, out)
    kv = torch.stack([chunks[0].keys, chunks[0].values], dim=2)[2, chunks[0].ranking]
    assert torch.equal(out, torch.cat([kv[3:40], kv[8:9], kv[13:22]]))
    assert fresh.errors == 0


def test_a_file_rewritten_in_place_keeping_size_and_mtime_fails_its_next_range_read(tmp_path, small_blocks) -> None:
    chunk, path = write_and_locate(tmp_path)
    store = DiskStore(tmp_path, FP)
    stored = store.get(chunk.chunk_id)
    st = os.stat(path)
    start, end = kv_region(path.read_bytes())
    with open(path, "r+b") as f:  # one byte of the last layer's rows, in place
        f.seek(end - 200)
        byte = f.read(1)
        f.seek(end - 200)
        f.write(bytes([byte[0] ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert store.get(chunk.chunk_id) is stored  # nothing the identity check can see
    k, _ = stored.load_layer(0, torch.arange(chunk.num_tokens))  # other layers are intact
    assert torch.equal(k, chunk.keys[0]) and store.errors == 0
    with pytest.raises(CorruptChunkError, match="changed since the chunk was verified"):
        stored.load_layer(L - 1, chunk.ranking[-3:])
    assert store.errors == 1
    assert_corrupt_and_dropped(store, chunk.chunk_id, path)  # the handle was dropped: verified again, deleted


def test_an_engine_re_encodes_a_disk_chunk_rewritten_in_place_keeping_size_and_mtime(tmp_path) -> None:
    from cachetune.runtime.decode import SamplingConfig
    from conftest import tiny_engine, words

    engine = tiny_engine(tiers=f"disk:{tmp_path}", self_check=False)
    docs = [words(60, s) for s in (41, 42)]
    ids = [engine.cache_chunk(d) for d in docs]
    sampling = SamplingConfig(max_new_tokens=5, ignore_eos=True)
    first = engine.generate(ids, "w1 w2", sampling=sampling).token_ids
    encoded, store = engine.chunks_encoded, engine.store
    path = store.path(ids[0])
    st = os.stat(path)
    start, end = kv_region(path.read_bytes())
    with open(path, "r+b") as f:  # the last rows of the last layer (reused, never recomputed) made huge
        f.seek(end - 1024)
        f.write(b"\x7f" * 1024)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_size == st.st_size
    second = engine.generate(ids, "w1 w2", sampling=sampling).token_ids
    assert second == first
    assert store.errors >= 1
    assert engine.chunks_encoded == encoded + 1  # the rewritten chunk, and only it, encoded again
    assert verify(path.read_bytes(), engine.fingerprint, ids[0], None) is not None  # a good file again


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_blob_of_the_previous_format_is_not_ours_and_an_engine_re_encodes_it(tmp_path, tier, request) -> None:
    from cachetune.runtime.decode import SamplingConfig
    from conftest import tiny_engine, words

    spec = f"disk:{tmp_path}" if tier == "disk" else request.getfixturevalue("redis_server").url
    reference = tiny_engine(tiers="cpu:64MiB", self_check=False)
    doc = words(50, 43)
    cid = reference.cache_chunk(doc)
    sampling = SamplingConfig(max_new_tokens=4, ignore_eos=True)
    want = reference.generate([cid], "w5", sampling=sampling).token_ids
    old = pack_previous_format(reference.store.get(cid).encoded(), reference.fingerprint)

    engine = tiny_engine(tiers=spec, self_check=False)
    if tier == "disk":
        engine.store.path(cid).write_bytes(old)
    else:
        engine.store.client.set(engine.store.key(cid), old)
    assert engine.cache_chunk(doc) == cid and engine.chunks_encoded == 1  # found, refused, encoded
    assert engine.generate([cid], "w5", sampling=sampling).token_ids == want
    stored = engine.store.get(cid)
    assert stored is not None and stored.layout.sums is not None  # the tier now holds the new format
