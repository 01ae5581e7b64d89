"""The Redis tier against a real redis-server: shared between processes, and never a failed request
when the server is down, killed or evicts values."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cachetune.config import parse_tiers
from cachetune.runtime.decode import SamplingConfig
from cachetune.store.base import CorruptChunkError
from cachetune.store.blob import verify
from cachetune.store.memory import MemoryStore
from cachetune.store.redis import RETRY_S, RedisStore, TierUnavailableError
from cachetune.store.tiered import TieredStore
from conftest import tiny_engine, words
from test_store import FP, L, HKV, D, kv_region, make_chunk, small_blocks  # noqa: F401 (a fixture)

TESTS = Path(__file__).parent


def greedy(n: int) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=n, ignore_eos=True)


def dead_url() -> str:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}"


def test_parse_redis_tiers() -> None:
    tiers = parse_tiers("cpu:1GiB,disk:/tmp/x:2GiB,redis://10.0.0.5:6380/2")
    assert [t.kind for t in tiers] == ["cpu", "disk", "redis"]
    assert tiers[2].path == "redis://10.0.0.5:6380/2" and tiers[2].max_bytes is None
    for bad in ("redis:6379", "redis://", "redis://h:1,cpu"):
        with pytest.raises(ValueError):
            parse_tiers(bad)


def test_put_get_and_range_reads(redis_url, tmp_path) -> None:
    store = RedisStore(redis_url, FP, prefix=str(tmp_path))
    chunk = make_chunk(n=40, seed=3)
    assert store.get(chunk.chunk_id) is None
    store.put(chunk)
    got = RedisStore(redis_url, FP, prefix=str(tmp_path)).get(chunk.chunk_id)  # a fresh client: verified from the server
    assert got is not None and torch.equal(got.token_ids, chunk.token_ids) and torch.equal(got.ranking, chunk.ranking)
    idx = torch.tensor([5, 0, 39, 17])
    for layer in range(chunk.keys.shape[0]):
        k, v = got.load_layer(layer, idx)
        assert torch.equal(k, chunk.keys[layer][idx]) and torch.equal(v, chunk.values[layer][idx])
    whole = got.encoded()
    assert torch.equal(whole.keys, chunk.keys) and torch.equal(whole.values, chunk.values)
    store.remove(chunk.chunk_id)
    assert store.get(chunk.chunk_id) is None


def test_a_corrupt_value_is_dropped_and_never_used(redis_server) -> None:
    store = RedisStore(redis_server.url, FP)
    chunk = make_chunk(seed=4)
    store.put(chunk)
    key = store.key(chunk.chunk_id)
    client = redis_server.client()
    blob = bytearray(client.get(key))
    blob[-3] ^= 0xFF
    client.set(key, bytes(blob))
    with pytest.raises(CorruptChunkError, match="checksum"):
        RedisStore(redis_server.url, FP).get(chunk.chunk_id)
    assert client.exists(key) == 0


def test_unreachable_at_start_is_a_miss_with_a_warning_and_a_counter(caplog) -> None:
    store = RedisStore(dead_url(), FP)
    chunk = make_chunk()
    with caplog.at_level(logging.WARNING, logger="cachetune.store.redis"):
        store.put(chunk)
        assert store.get(chunk.chunk_id) is None
    assert store.errors >= 1 and "unavailable" in caplog.text


def test_an_engine_without_its_redis_still_serves_by_recomputing() -> None:
    engine = tiny_engine(tiers=f"cpu:64MiB,{dead_url()}", self_check=False)
    alone = tiny_engine(tiers="cpu:64MiB", self_check=False)
    docs = [words(60, s) for s in (1, 2)]
    got = engine.generate([engine.cache_chunk(d) for d in docs], "w1 w2 w3", sampling=greedy(6))
    assert got.token_ids == alone.generate([alone.cache_chunk(d) for d in docs], "w1 w2 w3", sampling=greedy(6)).token_ids
    assert engine.store.tiers[1].errors >= 1


def test_redis_killed_mid_request_then_back(redis_server) -> None:
    engine = tiny_engine(tiers=redis_server.url, self_check=False)
    reference = tiny_engine(tiers="cpu:64MiB", self_check=False)
    docs = [words(50, s) for s in (5, 6, 7)]
    ids = [engine.cache_chunk(d) for d in docs]
    want = reference.generate([reference.cache_chunk(d) for d in docs], "w9 w8", sampling=greedy(5)).token_ids

    request = engine.add_request(ids, "w9 w8", sampling=greedy(5))  # its chunks are looked up now ...
    redis_server.kill()                                             # ... and the server dies before they are read
    while engine.has_unfinished():
        engine.step()
    assert request.error is None and request.output_ids == want
    assert engine.store.errors >= 1

    redis_server.start()
    import time

    time.sleep(RETRY_S + 0.1)
    other = make_chunk(seed=9, fingerprint=engine.fingerprint, dtype=torch.float32)
    engine.store.put(other)  # reconnected: the tier works again
    assert redis_server.client().exists(engine.store.key(other.chunk_id)) == 1


def test_while_redis_is_down_a_chunk_is_encoded_once_and_goes_back_to_redis_when_it_returns(redis_server) -> None:
    engine = tiny_engine(tiers=redis_server.url, self_check=False)
    docs = [words(50, s) for s in (11, 12)]
    ids = [engine.cache_chunk(d) for d in docs]
    redis_server.kill()
    answers = [engine.generate(ids, "w3 w4", sampling=greedy(4)).token_ids for _ in range(3)]
    assert engine.chunks_encoded == 2 + 2  # each chunk once for the outage (kept in the fallback memory)
    assert engine.cache_chunk(docs[0]) == ids[0] and engine.chunks_encoded == 4
    assert answers == [answers[0]] * 3

    redis_server.start()  # empty: the fallback copies are offered to it again
    import time

    time.sleep(RETRY_S + 0.1)
    assert engine.generate(ids, "w3 w4", sampling=greedy(4)).token_ids == answers[0]
    assert all(redis_server.client().exists(engine.store.key(cid)) == 1 for cid in ids)  # all at first use
    assert engine.chunks_encoded == 4


def test_a_value_evicted_by_the_server_is_a_miss_and_a_request_recovers(redis_server) -> None:
    engine = tiny_engine(tiers=redis_server.url, self_check=False)
    docs = [words(50, s) for s in (11, 12)]
    ids = [engine.cache_chunk(d) for d in docs]
    reference = tiny_engine(tiers="cpu:64MiB", self_check=False)
    want = reference.generate([reference.cache_chunk(d) for d in docs], "w4", sampling=greedy(4)).token_ids
    request = engine.add_request(ids, "w4", sampling=greedy(4))
    redis_server.client().delete(engine.store.key(ids[0]))  # the server let the value go mid-request
    while engine.has_unfinished():
        engine.step()
    assert request.error is None and request.output_ids == want


def test_the_servers_own_lru_eviction_is_a_miss_never_an_error(redis_server) -> None:
    client = redis_server.client()
    client.config_set("maxmemory", str(2 * 2**20))
    client.config_set("maxmemory-policy", "allkeys-lru")
    store = RedisStore(redis_server.url, FP)
    chunks = [make_chunk(n=300, seed=s) for s in range(30)]  # ~0.3 MB each: more than the server keeps
    for chunk in chunks:
        store.put(chunk)
    found = [store.get(c.chunk_id) for c in chunks]
    assert found[0] is None and found[-1] is not None  # the oldest were evicted by the server
    for chunk, got in zip(chunks, found):
        if got is not None:
            assert torch.equal(got.load_layer(0, chunk.ranking)[0], chunk.keys[0][chunk.ranking])


def test_a_range_read_of_an_evicted_value_raises_for_a_retry(redis_server) -> None:
    store = RedisStore(redis_server.url, FP)
    chunk = make_chunk(seed=5)
    store.put(chunk)
    got = store.get(chunk.chunk_id)
    redis_server.client().delete(store.key(chunk.chunk_id))
    with pytest.raises(TierUnavailableError):
        got.load_layer(0, torch.arange(4))
    assert store.get(chunk.chunk_id) is None


def test_two_processes_share_one_redis(redis_server) -> None:
    text = words(80, 21)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from conftest import tiny_engine
        engine = tiny_engine(tiers={redis_server.url!r}, self_check=False)
        print(engine.cache_chunk({text!r}), engine.chunks_encoded)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    cid, encoded = out.stdout.split()
    assert encoded == "1"
    engine = tiny_engine(tiers=f"cpu:64MiB,{redis_server.url}", self_check=False)
    assert engine.cache_chunk(text) == cid
    result = engine.generate([cid], "w3", sampling=greedy(3))
    assert result.token_ids and engine.chunks_encoded == 0  # reused from the other process, not re-encoded
    assert engine.store.hits[1] >= 1


def test_a_tiered_store_promotes_from_redis(redis_url, tmp_path) -> None:
    writer = RedisStore(redis_url, FP, prefix=str(tmp_path))
    chunk = make_chunk(seed=8)
    writer.put(chunk)
    store = TieredStore([MemoryStore(), RedisStore(redis_url, FP, prefix=str(tmp_path))])
    got = store.get(chunk.chunk_id)
    assert got is not None and store.hits == [0, 1]
    assert store.get(chunk.chunk_id) is not None and store.hits == [1, 1]  # now from memory
    assert torch.equal(got.load_layer(1, chunk.ranking)[1], chunk.values[1][chunk.ranking])


# --- range verification: a value changed after its first (verified) read is caught, never used --------


def _tampered_then_asked_again(redis_server, tamper) -> None:
    """Ask once, `tamper(client, engine, ids)`, ask again: the same answer, the bad range counted as a
    tier error, the tampered chunk (and only it) encoded again, its key holding a good value."""
    engine = tiny_engine(tiers=redis_server.url, self_check=False)
    docs = [words(60, s) for s in (51, 52)]  # two chunks of 60 tokens: values of one length
    ids = [engine.cache_chunk(d) for d in docs]
    first = engine.generate(ids, "w1 w2", sampling=greedy(6)).token_ids
    encoded, errors = engine.chunks_encoded, engine.store.errors
    client = redis_server.client()
    before = client.get(engine.store.key(ids[0]))
    tamper(client, engine, ids)
    assert client.get(engine.store.key(ids[0])) != before and client.strlen(engine.store.key(ids[0])) == len(before)
    second = engine.generate(ids, "w1 w2", sampling=greedy(6)).token_ids
    assert second == first
    assert engine.store.errors > errors
    assert engine.chunks_encoded == encoded + 1
    verify(client.get(engine.store.key(ids[0])), engine.fingerprint, ids[0], engine.store.shape)  # good again


def test_a_value_overwritten_in_part_after_its_first_read_is_caught_and_re_encoded(redis_server) -> None:
    def setrange(client, engine, ids):
        key = engine.store.key(ids[0])
        _, end = kv_region(client.get(key))
        client.setrange(key, end - 1024, b"\x7f" * 1024)  # the last rows of the last layer: reused rows

    _tampered_then_asked_again(redis_server, setrange)


def test_a_value_copied_from_another_chunk_is_caught_and_re_encoded(redis_server) -> None:
    def copy(client, engine, ids):
        other = client.get(engine.store.key(ids[1]))
        assert len(other) == client.strlen(engine.store.key(ids[0]))
        client.set(engine.store.key(ids[0]), other)

    _tampered_then_asked_again(redis_server, copy)


def test_a_bad_range_counts_as_a_tier_error_and_drops_the_handle(redis_server, small_blocks) -> None:
    store = RedisStore(redis_server.url, FP)
    chunk = make_chunk(n=40, seed=27)
    store.put(chunk)
    got = store.get(chunk.chunk_id)
    key, client = store.key(chunk.chunk_id), redis_server.client()
    lay = got.layout
    at = lay.span(1, 30, 31)[0]  # a byte of rank row 30 of layer 1, flipped
    client.setrange(key, at, bytes([client.getrange(key, at, at)[0] ^ 0xFF]))
    rows = got.ranking[:25]  # ranks [0, 25): blocks 0-3 of 7 rows, untouched
    assert torch.equal(got.load_layer(1, rows)[0], chunk.keys[1][rows]) and store.errors == 0
    with pytest.raises(CorruptChunkError, match="changed since the chunk was verified"):
        got.load_layer(1, got.ranking[29:])  # rank 29 widens to block [28, 35), which holds row 30
    assert store.errors == 1
    with pytest.raises(CorruptChunkError, match="checksum"):  # not the held handle: the whole value again
        store.get(chunk.chunk_id)
    assert client.exists(key) == 0


def test_widened_redis_reads_return_exactly_the_requested_rows(redis_server, small_blocks) -> None:
    store = RedisStore(redis_server.url, FP)
    chunks = [make_chunk(n=40, seed=28), make_chunk(n=17, seed=29, dtype=torch.bfloat16)]
    for ch in chunks:
        store.put(ch)
    fresh = RedisStore(redis_server.url, FP)
    for ch in chunks:
        stored = fresh.get(ch.chunk_id)
        kv = torch.stack([ch.keys, ch.values], dim=2)[:, ch.ranking]
        n = ch.num_tokens
        spans = [(stored, lo, hi) for lo in range(n + 1) for hi in range(lo, n + 1)]
        want = torch.cat([kv[:, lo:hi] for _, lo, hi in spans], dim=1)
        for layer in range(L):  # every range of the chunk, all in one pipelined plan
            out = torch.empty(want.shape[1], 2, HKV, D, dtype=ch.keys.dtype)
            fresh.reader.plan(spans)(layer, out)
            assert torch.equal(out, want[layer])
    assert fresh.errors == 0
