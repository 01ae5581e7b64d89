"""Shared builders for the engine tests: tiny random-weight models (no download) and prompt layouts.

CACHETUNE_TEST_DEVICE=cuda runs the tiny models (and the engine, whose device defaults to a GPU when
there is one) on a GPU; references are then computed there too. CI runs on the CPU.

Models use initializer_range=0.2 so attention is far from uniform: with HF's default 0.02 a key at a
wrong position barely moves the logits and an exactness test could not fail. Everything is float32 and
seeded; references are always Hugging Face's own forward, never cachetune code.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from cachetune.chunks.encode import encode_chunk
from cachetune.config import EngineConfig
from cachetune.engine.engine import Engine
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.model.adapter import ModelAdapter
from cachetune.model.loader import LoadedModel
from cachetune.store.memory import MemoryStore

VOCAB = 300
TEST_DEVICE = torch.device(os.environ.get("CACHETUNE_TEST_DEVICE", "cpu"))
FINGERPRINT = "fp"

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def make_config(family: str):
    """Tiny config per family. Sliding windows (64) are much shorter than the test prompts (>300)."""
    if family == "llama":
        return LlamaConfig(**_COMMON)
    if family == "llama3_rope":
        return LlamaConfig(**_COMMON, rope_parameters=dict(LLAMA3_ROPE))
    if family == "mistral":
        return MistralConfig(**_COMMON, sliding_window=64)
    if family == "qwen2":
        return Qwen2Config(**_COMMON)
    if family == "qwen2_sliding":  # per-layer windows: layer 0 full, layers >= 1 sliding
        return Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=64, max_window_layers=1)
    if family == "qwen3":
        return Qwen3Config(**_COMMON, head_dim=16)
    if family == "qwen3_head24":  # head_dim * heads != hidden_size (as in e.g. Qwen3, Mistral Nemo)
        return Qwen3Config(**_COMMON, head_dim=24)
    if family in ("gemma3_text", "gemma3_text_softcap"):
        extra = {"final_logit_softcapping": 5.0} if family.endswith("softcap") else {}
        return Gemma3TextConfig(
            **_COMMON,
            head_dim=16,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            **extra,
        )
    raise KeyError(family)


@functools.lru_cache(maxsize=None)
def _build(family: str, seed: int):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family), attn_implementation="sdpa").eval()
    model.float().to(TEST_DEVICE)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def build_model(family: str, seed: int = 0):
    """Cached across the session: tests must not modify the model (monkeypatch the adapter instead)."""
    return _build(family, seed)


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: tiny_model(family, seed=0) -> eval float32 HF causal LM."""
    return build_model


@pytest.fixture(scope="session")
def tiny_adapter():
    """Factory: tiny_adapter(family) -> (model, fresh ModelAdapter). A fresh adapter is safe to monkeypatch."""

    def make(family: str, seed: int = 0):
        model = build_model(family, seed)
        return model, ModelAdapter(model)

    return make


@pytest.fixture(scope="session")
def tiny_vllm_model(tmp_path_factory) -> Path:
    """An HF directory vLLM serves with tensor parallelism 2: a random Llama with 4 query and 2 KV heads
    (the bundled model's 9 do not divide by 2) and the bundled model's tokenizer and chat template. Its
    weights are wide enough that greedy tokens vary."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from cachetune.model.loader import model_directory

    out = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(model_directory())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         rope_theta=100000.0, initializer_range=0.1, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the tiny vocabulary: "w{i}" is token i + 3; 0-2 are <unk>, <s>, </s>."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def words(n: int, seed: int) -> str:
    """Text of n random words of the tiny vocabulary (never the special tokens)."""
    return " ".join(f"w{int(i) - 3}" for i in rand_ids(n, seed))


def tiny_engine(family: str = "llama", **config) -> Engine:
    """An Engine on a tiny random model with the word-level tokenizer (plain prompt format)."""
    loaded = LoadedModel(build_model(family), word_tokenizer(), f"tiny-{family}", Path("."))
    return Engine(loaded, EngineConfig(**config))


def rand_ids(n: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """Random token ids in [3, vocab) (special ids 0..2 avoided)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g)


def build_layout(adapter: ModelAdapter, parts, store: MemoryStore | None = None):
    """parts: list of (token_ids, cached: bool) in prompt order -> (PromptLayout, store).

    Cached parts are encoded alone with encode_chunk, put in a MemoryStore and referenced through
    store.get(id), exactly as the engine does.
    """
    store = store if store is not None else MemoryStore()
    segments = []
    for ids, cached in parts:
        if cached:
            enc = encode_chunk(adapter, ids, FINGERPRINT)
            store.put(enc)
            segments.append(Segment(ids, store.get(enc.chunk_id)))
        else:
            segments.append(Segment(ids))
    return PromptLayout(segments), store


@pytest.fixture(scope="session")
def layout_builder():
    return build_layout


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    """max |ref - got| / max |ref| (NaN-safe: NaN gives inf)."""
    ref, got = ref.detach().float().cpu(), got.detach().float().cpu()
    err = float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-12))
    return err if err == err else float("inf")


def assert_close(ref: torch.Tensor, got: torch.Tensor, tol: float = 1e-4, what: str = "") -> None:
    assert ref.shape == got.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    err = rel_err(ref, got)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


@torch.no_grad()
def hf_forward(model, ids: torch.Tensor, position_ids: torch.Tensor | None = None, cache=None):
    """HF forward of ids [T]; returns (logits [T, vocab] float32, cache).

    A plain DynamicCache() (no config) keeps every row of every layer: with the config, HF would create
    sliding-window layers that keep only the last window-1 rows.
    """
    cache = cache if cache is not None else DynamicCache()
    kwargs = {}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids[None].to(model.device)
    out = model(input_ids=ids[None].to(model.device), past_key_values=cache, use_cache=True, **kwargs)
    return out.logits[0].float(), cache


def hf_layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated keys and values [T, Hkv, D] of one layer of an HF cache ([1, Hkv, T, D])."""
    entry = cache.layers[layer]
    return entry.keys[0].transpose(0, 1), entry.values[0].transpose(0, 1)


# ----------------------------------------------------------------------------------------------------
# HF-only references for selective prefill (never cachetune code):
# - full recompute: HF forward of the whole prompt;
# - full reuse (ratio 0): every chunk run alone through HF with position_ids at its global offset (RoPE
#   is relative, so this is the chunk encoded alone with keys rotated where it lands); uncached text run
#   through HF on top of a DynamicCache holding everything before it;
# - partial reuse: HF forward of the whole prompt with hooks on k_proj (k_norm where the model has one)
#   and v_proj that overwrite the rows of non-recomputed chunk tokens with the chunk's independent
#   pre-RoPE K/V. A position's state depends on other positions only through their K/V, so this is
#   exactly "recompute the selected tokens in context, reuse the rest".


def hf_cache_from_rows(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> DynamicCache:
    """DynamicCache (all layers full) holding rotated keys/values given as [T, Hkv, D] per layer."""
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(ks, vs)):
        cache.update(k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous(), layer)
    return cache


@torch.no_grad()
def hf_concat_reference(model, parts):
    """Full KV reuse built with HF only. parts: [(ids, cached)], last part uncached.

    Returns (last-token logits [vocab], keys, values) with keys/values lists of [T, Hkv, D] per layer.
    """
    num_layers = model.config.num_hidden_layers
    ks = [[] for _ in range(num_layers)]
    vs = [[] for _ in range(num_layers)]
    start, logits = 0, None
    for ids, cached in parts:
        n = ids.numel()
        pos = torch.arange(start, start + n)
        if cached:
            _, cache = hf_forward(model, ids, pos)  # the chunk alone, keys rotated at global positions
            new = [hf_layer_kv(cache, i) for i in range(num_layers)]
        else:
            past = hf_cache_from_rows([torch.cat(k) for k in ks], [torch.cat(v) for v in vs]) if start else None
            out, cache = hf_forward(model, ids, pos, cache=past)
            logits = out[-1]
            new = [(k[start:], v[start:]) for k, v in (hf_layer_kv(cache, i) for i in range(num_layers))]
        for i, (k, v) in enumerate(new):
            ks[i].append(k)
            vs[i].append(v)
        start += n
    return logits, [torch.cat(k) for k in ks], [torch.cat(v) for v in vs]


def _kv_modules(model):
    """Per layer: (module whose output is the pre-RoPE key, module whose output is the value)."""
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        out.append((attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj, attn.v_proj))
    return out


def _tokens_first(x: torch.Tensor, n: int) -> torch.Tensor:
    """View of a projection/norm output with the token axis at dim 1 ([1, n, ...]).

    k_proj/v_proj give [1, T, H*D]; Qwen 3 normalises k as [1, T, H, D], Gemma 3 as [1, H, T, D].
    """
    if x.shape[1] == n:
        return x
    assert x.dim() == 4 and x.shape[2] == n, tuple(x.shape)
    return x.movedim(2, 1)


@torch.no_grad()
def _capture_pre_rope(model, ids: torch.Tensor):
    """Independent (chunk alone, positions 0..n-1) pre-RoPE K and V outputs of every layer, via hooks."""
    captured, handles = {}, []
    n = ids.numel()
    for i, (kmod, vmod) in enumerate(_kv_modules(model)):
        for kind, mod in (("k", kmod), ("v", vmod)):
            hook = lambda m, a, o, key=(kind, i): captured.__setitem__(key, _tokens_first(o, n).clone())  # noqa: E731
            handles.append(mod.register_forward_hook(hook))
    try:
        hf_forward(model, ids)
    finally:
        for h in handles:
            h.remove()
    return captured


@torch.no_grad()
def hf_partial_reference(model, parts, selections):
    """Selective recompute built on HF's forward: rows of non-selected chunk tokens get independent K/V.

    parts: [(ids, cached)]; selections: per cached part, local indices recomputed in context.
    Returns (last-token logits [vocab], keys, values) like hf_concat_reference.
    """
    # global position -> (("k"/"v", layer) -> replacement row), collected per chunk
    replace_pos, sources = [], []
    start, sel_iter = 0, iter(selections)
    for ids, cached in parts:
        if cached:
            chosen = next(sel_iter)
            keep = torch.ones(ids.numel(), dtype=torch.bool)
            keep[chosen] = False
            local = keep.nonzero().flatten()
            replace_pos.append(start + local)
            sources.append((_capture_pre_rope(model, ids), local))
        start += ids.numel()
    handles, total = [], start

    def make_hook(kind, layer):
        def hook(module, args, output):
            output = output.clone()
            rows = _tokens_first(output, total)  # a view: writes land in `output`
            for pos, (captured, local) in zip(replace_pos, sources):
                rows[0, pos] = captured[(kind, layer)][0, local]
            return output

        return hook

    for i, (kmod, vmod) in enumerate(_kv_modules(model)):
        handles.append(kmod.register_forward_hook(make_hook("k", i)))
        handles.append(vmod.register_forward_hook(make_hook("v", i)))
    try:
        logits, cache = hf_forward(model, torch.cat([ids for ids, _ in parts]))
    finally:
        for h in handles:
            h.remove()
    kv = [hf_layer_kv(cache, i) for i in range(model.config.num_hidden_layers)]
    return logits[-1], [k for k, _ in kv], [v for _, v in kv]


def assert_cache_matches(result, keys, values, tol=1e-4, rows=None, what=""):
    """Compare PrefillResult.cache rows (all, or `rows`) with reference per-layer [T, Hkv, D]."""
    n = keys[0].shape[0]
    assert result.cache.length == n
    idx = torch.arange(n) if rows is None else rows
    for layer, (k, v) in enumerate(zip(keys, values)):
        assert_close(k[idx], result.cache.keys[layer, :n][idx], tol, f"{what} keys layer {layer}")
        assert_close(v[idx], result.cache.values[layer, :n][idx], tol, f"{what} values layer {layer}")


def assert_cache_matches_hf(result, hf_cache, num_layers, tol=1e-4, rows=None, what=""):
    """assert_cache_matches against every layer of a transformers cache."""
    kv = [hf_layer_kv(hf_cache, i) for i in range(num_layers)]
    assert_cache_matches(result, [k for k, _ in kv], [v for _, v in kv], tol=tol, rows=rows, what=what)


def all_selected(layout):
    return [torch.arange(seg.token_ids.numel()) for _, seg in layout.chunk_segments]


def none_selected(layout):
    return [torch.empty(0, dtype=torch.int64) for _ in layout.chunk_segments]


def random_selected(layout, ratio: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _, seg in layout.chunk_segments:
        n = seg.token_ids.numel()
        out.append(torch.randperm(n, generator=g)[: int(round(ratio * n))].sort().values)
    return out


def generated_ids(decoded) -> list[int]:
    """generate_tokens returns the id list (older versions: an object with .ids)."""
    return list(getattr(decoded, "ids", decoded))


def served_answer_logits(engine: Engine, prompt, method: str, answer: torch.Tensor):
    """(prefill, logits [len(answer), vocab]): `method` serving `prompt`, then teacher-forced on `answer`."""
    served = engine.prefill(prompt, method)
    return served, torch.cat([served.logits[None], served.extend(engine.adapter, answer[:-1].tolist())])


def train_steps(engine: Engine, tokens: torch.nn.Module, sample, logits_fn, lr: float, steps: int):
    """(loss before, loss after) `steps` AdamW steps on one sample, over `tokens`' trainable tensors."""
    from cachetune.train.objective import sample_loss

    optimizer = torch.optim.AdamW(list(tokens.trainable().values()), lr=lr)
    with torch.enable_grad():
        start = float(sample_loss(engine.adapter, tokens, sample, logits_fn).detach())
        for _ in range(steps):
            optimizer.zero_grad()
            sample_loss(engine.adapter, tokens, sample, logits_fn).backward()
            optimizer.step()
        end = float(sample_loss(engine.adapter, tokens, sample, logits_fn).detach())
    return start, end


def alone_then_added(engine: Engine, method: str, sizes=(33, 18, 41)):
    """(token ids of each request generated alone, the same requests added to the engine, not yet
    stepped): request i asks over the chunks i.. of documents of `sizes` words, 5 tokens each."""
    from cachetune import SamplingConfig

    ids = [engine.cache_chunk(words(n, 60 + n)) for n in sizes]
    sampling = SamplingConfig(max_new_tokens=5, ignore_eos=True)
    alone = [engine.generate(ids[i:], words(4, i), method=method, sampling=sampling).token_ids
             for i in range(len(ids))]
    return alone, [engine.add_request(ids[i:], words(4, i), method=method, sampling=sampling)
                   for i in range(len(ids))]


@pytest.fixture(autouse=True)
def _restore_grad_mode():
    """The CLI's main() turns autograd off for its process; a test that calls it must not leak that."""
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


def run_in_threads(target, args: list) -> None:
    """Run target(a) for every a in `args`, each in its own thread, all at once; wait for all."""
    import threading

    threads = [threading.Thread(target=target, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class RedisServer:
    """A real redis-server on a free loopback port, owned by one test (which may stop and restart it)."""

    def __init__(self, binary: str, tmp: Path):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.binary, self.tmp, self.proc = binary, tmp, None
        self.url = f"redis://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def client(self):
        import redis

        return redis.Redis(port=self.port)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    """A fresh real redis-server for this test. Skipped when the binary is missing, unless
    CACHETUNE_REQUIRE_REDIS is set (CI installs it: a missing server fails there)."""
    import shutil

    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        if os.environ.get("CACHETUNE_REQUIRE_REDIS"):
            pytest.fail("redis-server is required (CACHETUNE_REQUIRE_REDIS) but not installed")
        pytest.skip("redis-server is not installed (apt install redis-server)")
    server = RedisServer(binary, tmp_path)
    yield server
    server.kill()


@pytest.fixture
def redis_url(request, tmp_path):
    """A running Redis for tests that leave it running: CI's (CACHETUNE_TEST_REDIS), else a fresh one."""
    url = os.environ.get("CACHETUNE_TEST_REDIS")
    return url if url else request.getfixturevalue("redis_server").url
