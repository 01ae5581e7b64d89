"""Tiers that compose: eviction demotes, a hit in a slower tier promotes, shared tiers are written
through, a corrupt entry anywhere is never used, and the chain is safe under threads."""

from __future__ import annotations


import pytest
import torch

from cachetune.store.base import CorruptChunkError
from cachetune.store.blob import pack
from cachetune.store.disk import DiskStore
from cachetune.store.memory import MemoryStore
from cachetune.store.tiered import TieredStore
from conftest import run_in_threads
from test_store import FP, L, chunk_nbytes, make_chunk


def assert_same_rows(stored, chunk) -> None:
    every = torch.arange(chunk.num_tokens)
    for layer in range(L):
        k, v = stored.load_layer(layer, every)
        assert torch.equal(k, chunk.keys[layer]) and torch.equal(v, chunk.values[layer])
    assert torch.equal(stored.ranking, chunk.ranking) and torch.equal(stored.scores, chunk.scores)


def test_eviction_demotes_and_a_slow_hit_promotes(tmp_path) -> None:
    chunks = [make_chunk(seed=s) for s in range(3)]
    memory = MemoryStore(max_bytes=2 * chunk_nbytes(chunks[0]))
    disk = DiskStore(tmp_path, FP)
    disk.shared = False  # only demotion may bring chunks here in this test
    store = TieredStore([memory, disk])
    for ch in chunks:
        store.put(ch)
    assert memory.get(chunks[0].chunk_id) is None and disk.get(chunks[0].chunk_id) is not None  # demoted
    assert disk.get(chunks[2].chunk_id) is None
    got = store.get(chunks[0].chunk_id)
    assert_same_rows(got, chunks[0])
    assert store.hits == [0, 1]
    assert memory.get(chunks[0].chunk_id) is not None  # promoted
    assert memory.get(chunks[1].chunk_id) is None and disk.get(chunks[1].chunk_id) is not None  # made room
    assert_same_rows(store.get(chunks[0].chunk_id), chunks[0])
    assert store.hits == [1, 1]


def test_shared_tiers_are_written_through_and_seen_by_another_store(tmp_path) -> None:
    chunk = make_chunk(seed=4)
    TieredStore([MemoryStore(), DiskStore(tmp_path, FP)]).put(chunk)
    other = TieredStore([MemoryStore(), DiskStore(tmp_path, FP)])  # another process's view of the folder
    assert_same_rows(other.get(chunk.chunk_id), chunk)
    assert other.hits == [0, 1]


def test_a_corrupt_slow_entry_is_dropped_and_reported_never_used(tmp_path) -> None:
    chunk = make_chunk(seed=5)
    TieredStore([MemoryStore(), DiskStore(tmp_path, FP)]).put(chunk)
    path = DiskStore(tmp_path, FP).path(chunk.chunk_id)
    path.write_bytes(path.read_bytes()[:-3])
    store = TieredStore([MemoryStore(), DiskStore(tmp_path, FP)])
    with pytest.raises(CorruptChunkError):
        store.get(chunk.chunk_id)
    assert not path.exists() and store.get(chunk.chunk_id) is None and store.misses == 2


def test_a_corrupt_entry_in_one_tier_falls_through_to_an_intact_slower_copy(tmp_path) -> None:
    chunk = make_chunk(seed=6)
    fast, slow = DiskStore(tmp_path / "fast", FP), DiskStore(tmp_path / "slow", FP)
    store = TieredStore([fast, slow])
    store.put(chunk)
    path = fast.path(chunk.chunk_id)
    path.write_bytes(path.read_bytes()[:-3])
    assert_same_rows(store.get(chunk.chunk_id), chunk)
    assert store.hits == [0, 1] and fast.get(chunk.chunk_id) is not None  # re-promoted, intact


def test_the_disk_budget_evicts_least_recently_used_files_first(tmp_path) -> None:
    chunks = [make_chunk(seed=s) for s in range(4)]
    disk = DiskStore(tmp_path, FP)
    disk.put(chunks[0])
    size = disk.nbytes
    disk = DiskStore(tmp_path, FP, max_bytes=3 * size)  # reopened: finds the first file
    assert disk.nbytes == size
    for ch in chunks[1:3]:
        disk.put(ch)
    assert disk.get(chunks[0].chunk_id) is not None  # now the most recent
    disk.put(chunks[3])
    present = [ch.chunk_id in disk for ch in chunks]
    assert present == [True, False, True, True] and disk.nbytes <= 3 * size
    assert not disk.path(chunks[1].chunk_id).exists()


def test_a_chain_of_three_moves_chunks_down_to_the_last_tier_and_drops_them_there(tmp_path) -> None:
    chunks = [make_chunk(seed=s) for s in range(5)]
    nbytes = chunk_nbytes(chunks[0])
    memory = MemoryStore(max_bytes=nbytes)
    disk = DiskStore(tmp_path / "a", FP)
    disk.shared = False
    size = len(pack(chunks[0], FP))
    disk.max_bytes = size
    last = DiskStore(tmp_path / "b", FP, max_bytes=2 * size)
    last.shared = False
    store = TieredStore([memory, disk, last])
    for ch in chunks:
        store.put(ch)
    where = [[ch.chunk_id in tier for tier in (memory, disk, last)] for ch in chunks]
    # memory holds 1, the middle tier 1, the last 2: the oldest chunk fell off the end
    assert where == [[False, False, False], [False, False, True], [False, False, True], [False, True, False],
                     [True, False, False]]


def test_the_chain_is_safe_under_threads(tmp_path) -> None:
    chunks = [make_chunk(n=16, seed=s) for s in range(12)]
    store = TieredStore([MemoryStore(max_bytes=3 * chunk_nbytes(chunks[0])), DiskStore(tmp_path, FP)])
    errors = []

    def worker(offset: int) -> None:
        try:
            for i in range(60):
                ch = chunks[(offset + i) % len(chunks)]
                store.put(ch)
                got = store.get(chunks[(offset + 3 * i) % len(chunks)].chunk_id)
                if got is not None:
                    want = chunks[(offset + 3 * i) % len(chunks)]
                    assert torch.equal(got.load_layer(1, want.ranking[4:])[0], want.keys[1][want.ranking[4:]])
        except Exception as exc:  # noqa: BLE001 - any exception is the failure under test
            errors.append(exc)

    run_in_threads(worker, [t * 4 for t in range(4)])
    assert errors == []
    for ch in chunks:  # everything is still there, intact, somewhere in the chain
        assert_same_rows(store.get(ch.chunk_id), ch)


# ============================================================== other rankers' scores, kept with the chunk


def some_scores(chunk, seed: int = 0) -> torch.Tensor:
    return torch.rand(chunk.num_tokens, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tier", ["memory", "disk", "redis"])
def test_scores_of_another_ranker_are_kept_with_the_chunk(tier, tmp_path, request) -> None:
    def open_tier():
        if tier == "memory":
            return memory
        if tier == "disk":
            return DiskStore(tmp_path, FP)  # every call: another process's view of the folder
        from cachetune.store.redis import RedisStore

        return RedisStore(request.getfixturevalue("redis_url"), FP, prefix=str(tmp_path))

    memory = MemoryStore()
    chunk, other = make_chunk(seed=1), make_chunk(seed=2)
    writer = open_tier()
    writer.put(chunk)
    scores = some_scores(chunk)
    writer.put_scores(chunk.chunk_id, "random", scores)
    writer.put_scores(other.chunk_id, "random", scores)  # a chunk it does not hold: ignored
    reader = open_tier()
    assert torch.equal(reader.get_scores(chunk.chunk_id, "random"), scores)
    assert reader.get_scores(chunk.chunk_id, "l2") is None
    assert reader.get_scores(other.chunk_id, "random") is None
    reader.remove(chunk.chunk_id)
    reader.put(chunk)
    assert open_tier().get_scores(chunk.chunk_id, "random") is None  # removed with the chunk


def test_a_bad_scores_file_is_dropped_and_never_used(tmp_path) -> None:
    store = DiskStore(tmp_path, FP)
    chunk = make_chunk(seed=3)
    store.put(chunk)
    store.put_scores(chunk.chunk_id, "random", some_scores(chunk))
    path = store.scores_path(chunk.chunk_id, "random")
    blob = bytearray(path.read_bytes())
    blob[-2] ^= 0xFF
    path.write_bytes(bytes(blob))
    assert store.get_scores(chunk.chunk_id, "random") is None and not path.exists()
    other = make_chunk(seed=4)  # scores of another chunk planted under this name
    store.put(other)
    store.put_scores(other.chunk_id, "random", some_scores(other))
    path.write_bytes(store.scores_path(other.chunk_id, "random").read_bytes())
    assert store.get_scores(chunk.chunk_id, "random") is None


def test_the_chain_writes_scores_through_and_promotes_them(tmp_path) -> None:
    chunk = make_chunk(seed=5)
    TieredStore([MemoryStore(), DiskStore(tmp_path, FP)]).put(chunk)
    first = TieredStore([MemoryStore(), DiskStore(tmp_path, FP)])
    assert first.get(chunk.chunk_id) is not None
    first.put_scores(chunk.chunk_id, "random", some_scores(chunk, 7))
    other = TieredStore([MemoryStore(), DiskStore(tmp_path, FP)])  # another process
    assert other.get(chunk.chunk_id) is not None
    assert torch.equal(other.get_scores(chunk.chunk_id, "random"), some_scores(chunk, 7))
    assert torch.equal(other.tiers[0].get_scores(chunk.chunk_id, "random"), some_scores(chunk, 7))  # promoted


def test_an_engine_finds_rankings_another_engine_computed(tmp_path) -> None:
    from conftest import tiny_engine, words

    tiers = f"cpu:64MiB,disk:{tmp_path}"
    first = tiny_engine(tiers=tiers, self_check=False)
    cid = first.cache_chunk(words(70, 3))
    want = first.rankings.scores(first.chunk(cid), "l2")  # not the stored ranker: computed now
    second = tiny_engine(tiers=tiers, self_check=False)
    assert second.cache_chunk(words(70, 3)) == cid and second.chunks_encoded == 0
    assert torch.equal(second.store.get_scores(cid, "l2"), want)
    assert torch.equal(second.rankings.scores(second.chunk(cid), "l2"), want)
