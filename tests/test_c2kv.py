"""C2KV's extractor, its mask and layout, and serving C2 rows: against references built from the HF
model's own modules (a joint forward of a document and its C2Tokens with an explicitly built mask)."""

from __future__ import annotations

import math

import pytest
import torch

from cachetune.c2kv.extractor import C2Extractor, ExtractorConfig, ExtractorError, block_ends, extract_c2kv
from cachetune.chunks.kv import encode_kv
from cachetune.methods import make_method
from cachetune.runtime.dense import masked_attention
from conftest import (alone_then_added, assert_close, hf_cache_from_rows, hf_forward, hf_layer_kv, rand_ids,
                      tiny_engine, words)

TOL = 1e-4
EOS = 2


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _hf_rotate(model, x, positions):
    """x [T, H, D] rotated at `positions` with the HF model's own rotary tables."""
    cos, sin = model.model.rotary_emb(x, positions[None].to(x.device))
    return x * cos[0][:, None] + _rotate_half(x) * sin[0][:, None]


def _reference_mask(n: int, block: int) -> torch.Tensor:
    """The paper's mask over [n document tokens, m C2Tokens], written out entry by entry."""
    m = math.ceil(n / block)
    mask = torch.zeros(n + m, n + m, dtype=torch.bool)
    for i in range(n):
        for j in range(i + 1):
            mask[i, j] = True  # documents: causal among themselves, never a C2Token
    for c in range(m):
        for j in range(n):
            mask[n + c, j] = j < block or j // block == c  # sink block and own block
        for d in range(c + 1):
            mask[n + c, n + d] = True  # earlier C2Tokens and itself
    return mask


@torch.no_grad()
def _joint_reference(model, extractor: C2Extractor, ids: torch.Tensor, block: int):
    """Document + C2Tokens in one sequence through the HF model's modules, C2 rows through the
    extractor's projections; returns per layer (pre-RoPE keys, values) [n + m, Hkv, D]."""
    n = ids.numel()
    m = math.ceil(n / block)
    backbone = model.model
    pos = torch.cat([torch.arange(n), torch.clamp(torch.arange(1, m + 1) * block, max=n) - 1])
    c2 = extractor.embedding[None].expand(m, -1)
    if extractor.config.anchor:  # each C2Token carries its block's last token
        c2 = c2 + backbone.embed_tokens(ids[pos[n:]].to(model.device))
    hidden = torch.cat([backbone.embed_tokens(ids.to(model.device)), c2])
    mask = _reference_mask(n, block).to(model.device)
    out = []
    for i, layer in enumerate(backbone.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        d = attn.head_dim
        q = torch.cat([attn.q_proj(x[:n]), extractor.q[i](x[n:])]).view(n + m, -1, d)
        k = torch.cat([attn.k_proj(x[:n]), extractor.k[i](x[n:])]).view(n + m, -1, d)
        v = torch.cat([attn.v_proj(x[:n]), extractor.v[i](x[n:])]).view(n + m, -1, d)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        out.append((k.clone(), v.clone()))
        qr, kr = _hf_rotate(model, q, pos), _hf_rotate(model, k, pos)
        g = q.shape[1] // k.shape[1]
        kr, vr = kr.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        scores = torch.einsum("thd,shd->hts", qr, kr) * attn.scaling
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        o = torch.einsum("hts,shd->thd", weights, vr).reshape(n + m, -1)
        hidden = hidden + attn.o_proj(o)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return out


def _extractor(adapter, **cfg) -> C2Extractor:
    return C2Extractor(adapter, ExtractorConfig(**cfg), "tiny", EOS)


def _perturbed_extractor(adapter, seed: int = 0, **cfg) -> C2Extractor:
    """An extractor whose parameters differ from the base copies (as after training)."""
    ex = _extractor(adapter, **cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ex.trainable().values():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.device))
    return ex


def _extract(adapter, ex, ids):
    keys, values = encode_kv(adapter, ids)
    with torch.no_grad():
        return extract_c2kv(adapter, ex, ids, keys, values)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("n", [37, 40])
@pytest.mark.parametrize("anchor", [False, True])
def test_extraction_equals_a_joint_forward_with_the_papers_mask(tiny_adapter, family, n, anchor):
    model, adapter = tiny_adapter(family)
    ex = _perturbed_extractor(adapter, anchor=anchor)
    ids = rand_ids(n, 5)
    ref = _joint_reference(model, ex, ids, 4)
    k, v, positions = _extract(adapter, ex, ids)
    assert positions.tolist() == block_ends(n, 4).tolist()
    for layer, (rk, rv) in enumerate(ref):
        assert_close(rk[n:], k[layer], TOL, f"C2 keys, layer {layer}")
        assert_close(rv[n:], v[layer], TOL, f"C2 values, layer {layer}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_document_token_kv_in_the_joint_forward_is_the_frozen_models(tiny_adapter, family):
    model, adapter = tiny_adapter(family)
    ids = rand_ids(30, 6)
    ref = _joint_reference(model, _perturbed_extractor(adapter), ids, 4)
    _, cache = hf_forward(model, ids)  # the document alone, no C2Tokens at all
    for layer, (rk, rv) in enumerate(ref):
        k, v = hf_layer_kv(cache, layer)
        assert_close(k, _hf_rotate(model, rk[:30], torch.arange(30)), TOL, f"document keys, layer {layer}")
        assert_close(v, rv[:30], TOL, f"document values, layer {layer}")


def test_a_token_outside_a_c2tokens_view_leaves_its_kv_bit_identical(tiny_adapter):
    _, adapter = tiny_adapter("llama")
    ex = _perturbed_extractor(adapter)
    ids = rand_ids(40, 7)
    k, v, _ = _extract(adapter, ex, ids)
    later = ids.clone()
    later[21] = (later[21] + 1) % 290 + 3   # block 5: C2Tokens 0..4 cannot see it
    k2, v2, _ = _extract(adapter, ex, later)
    assert torch.equal(k[:, :5], k2[:, :5]) and torch.equal(v[:, :5], v2[:, :5])
    assert not torch.allclose(k[:, 5], k2[:, 5])  # its own block's C2Token does see it
    sink = ids.clone()
    sink[1] = (sink[1] + 1) % 290 + 3       # the sink block: every C2Token sees it
    k3, _, _ = _extract(adapter, ex, sink)
    assert all(not torch.allclose(k[:, j], k3[:, j]) for j in range(k.shape[1]))


def test_an_earlier_c2token_carries_its_block_to_later_ones(tiny_adapter):
    _, adapter = tiny_adapter("llama")
    ex = _perturbed_extractor(adapter)
    ids = rand_ids(40, 8)
    k, _, _ = _extract(adapter, ex, ids)
    changed = ids.clone()
    changed[9] = (changed[9] + 1) % 290 + 3  # block 2: C2Token 2 sees it, and C2Tokens 3.. see C2Token 2
    k2, _, _ = _extract(adapter, ex, changed)
    assert torch.equal(k[:, :2], k2[:, :2])
    # Layer 0 keys depend only on the C2Token's own input; the change reaches later C2Tokens from layer 1.
    assert not torch.allclose(k[1:, 3], k2[1:, 3])


def test_the_untrained_extractor_copies_the_base_projections_and_the_eos_embedding(tiny_adapter):
    model, adapter = tiny_adapter("llama")
    ex = _extractor(adapter)
    assert torch.equal(ex.embedding, model.model.embed_tokens.weight[EOS])
    for i, layer in enumerate(model.model.layers):
        for mine, base in ((ex.q[i], layer.self_attn.q_proj), (ex.k[i], layer.self_attn.k_proj),
                           (ex.v[i], layer.self_attn.v_proj)):
            assert torch.equal(mine.weight, base.weight)
            assert mine.weight.data_ptr() != base.weight.data_ptr()  # a copy: training never touches the base


def test_lora_extractor_starts_at_the_copies_and_trains_only_the_adapters(tiny_adapter):
    _, adapter = tiny_adapter("llama")
    ids = rand_ids(21, 9)
    full, lora = _extractor(adapter), _extractor(adapter, lora_rank=4)
    assert_close(_extract(adapter, full, ids)[0], _extract(adapter, lora, ids)[0], 1e-6, "step-0 keys")
    names = set(lora.trainable())
    assert "embedding" in names and names - {"embedding"}
    assert all("lora_" in n for n in names - {"embedding"})


def test_residual_variant_adds_the_block_mean_of_normed_embeddings_at_layer_0(tiny_adapter):
    model, adapter = tiny_adapter("llama")
    ex = _extractor(adapter, residual=True)
    ids = rand_ids(10, 10)
    k, _, _ = _extract(adapter, ex, ids)
    layer = model.model.layers[0]
    normed = layer.input_layernorm(model.model.embed_tokens(ids))
    means = torch.stack([normed[0:4].mean(0), normed[4:8].mean(0), normed[8:10].mean(0)])
    x = layer.input_layernorm(ex.embedding[None].expand(3, -1)) + means
    expect = layer.self_attn.k_proj(x).view(3, -1, adapter.head_dim)
    assert_close(expect, k[0], TOL, "layer-0 C2 keys")


def test_an_untrained_anchored_c2token_starts_as_its_blocks_last_token(tiny_adapter):
    model, adapter = tiny_adapter("llama")
    ex = _extractor(adapter, anchor=True)
    assert not ex.embedding.any()  # the learned offset starts at zero
    ids = rand_ids(14, 12)
    k, v, positions = _extract(adapter, ex, ids)
    doc_k, doc_v = encode_kv(adapter, ids)
    # layer 0 sees only its input: the C2Token's K/V are exactly its block-end token's
    assert_close(doc_k[0][positions], k[0], TOL, "layer-0 C2 keys")
    assert_close(doc_v[0][positions], v[0], TOL, "layer-0 C2 values")
    plain, _, _ = _extract(adapter, _extractor(adapter), ids)
    assert not torch.allclose(plain[0], k[0])


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_fully_masked_row_gives_zeros_and_finite_gradients(backend, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 8, generator=g).to(device).requires_grad_()
    k = torch.randn(7, 2, 8, generator=g).to(device).requires_grad_()
    v = torch.randn(7, 2, 8, generator=g).to(device).requires_grad_()
    visible = torch.rand(5, 7, generator=g) > 0.5
    visible[0] = True
    visible[2] = False  # a query that sees nothing
    out = masked_attention(q, k, v, visible.to(device), 0.35, backend)
    out.square().sum().backward()
    assert torch.isfinite(out).all() and (out[2] == 0).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # The other rows are ordinary softmax attention over their visible keys.
    kk, vv = k.detach().repeat_interleave(2, dim=1), v.detach().repeat_interleave(2, dim=1)
    scores = torch.einsum("thd,shd->hts", q.detach(), kk) * 0.35
    ref = torch.einsum("hts,shd->thd", torch.softmax(scores.masked_fill(~visible.to(device), float("-inf")), -1), vv)
    rows = [0, 1, 3, 4]
    assert_close(ref[rows], out.detach()[rows], 1e-5, "visible rows")


def test_extractor_files_round_trip_and_refuse_another_model_or_a_broken_file(tiny_adapter, tmp_path):
    _, adapter = tiny_adapter("llama")
    ex = _perturbed_extractor(adapter, lora_rank=2)
    path = tmp_path / "ex.safetensors"
    ex.save(path, {"step": 3})
    back = C2Extractor.load(path, adapter, "tiny", EOS)
    assert back.fingerprint() == ex.fingerprint()
    assert back.fingerprint() != _extractor(adapter, lora_rank=2).fingerprint()
    with pytest.raises(ExtractorError, match="another base model"):
        C2Extractor.load(path, adapter, "other", EOS)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ExtractorError, match="not a readable"):
        C2Extractor.load(path, adapter, "tiny", EOS)


# ---- serving ------------------------------------------------------------------------------------


@torch.no_grad()
def _hf_c2kv_reference(engine, extractor, layout):
    """HF only for the assembly: the head's KV, then each document's C2 rows (pre-RoPE, from the
    extraction) rotated with HF's tables at start + block ends, then the question at full positions."""
    model = engine.model
    layers = model.config.num_hidden_layers
    head = layout.segments[0].token_ids
    _, head_cache = hf_forward(model, head)
    ks = [[hf_layer_kv(head_cache, i)[0]] for i in range(layers)]
    vs = [[hf_layer_kv(head_cache, i)[1]] for i in range(layers)]
    for start, seg in layout.chunk_segments:
        k, v, local = _extract(engine.adapter, extractor, seg.token_ids)
        for i in range(layers):
            ks[i].append(_hf_rotate(model, k[i], start + local))
            vs[i].append(v[i])
    past = hf_cache_from_rows([torch.cat(k) for k in ks], [torch.cat(v) for v in vs])
    q_pos = torch.arange(layout.starts[-1], layout.total)
    logits, _ = hf_forward(model, layout.segments[-1].token_ids, q_pos, cache=past)
    return logits[-1]


@pytest.mark.parametrize("spec", ["step0", "step0+residual", "step0+anchor"])
def test_c2kv_prefill_matches_hf_over_the_assembled_c2_rows(spec):
    engine = tiny_engine(threads=None)
    ids = [engine.cache_chunk(words(n, 80 + n)) for n in (33, 18, 41)]
    layout = engine.build_prompt(ids, words(5, 2))
    got = engine.prefill(layout, f"c2kv:{spec}")
    extractor = engine.extractors.get(spec).tokens
    assert_close(_hf_c2kv_reference(engine, extractor, layout), got.logits, TOL, "question logits")
    head, question = layout.segments[0].token_ids.numel(), layout.segments[-1].token_ids.numel()
    rows = head + 9 + 5 + 11 + question
    assert got.prompt_rows == got.cache.length == rows
    assert got.cache.next_position() == layout.total  # the question sat after the *original* lengths


def test_c2_rows_live_in_the_store_under_an_id_of_the_extractor(tmp_path):
    engine = tiny_engine(threads=None, tiers=f"disk:{tmp_path}")
    cid = engine.cache_chunk(words(30, 90))
    layout = engine.build_prompt([cid], words(4, 3))
    before = {p.name for p in tmp_path.rglob("*.safetensors")}
    plain = engine.prefill(layout, "c2kv:step0").logits
    after = {p.name for p in tmp_path.rglob("*.safetensors")}
    engine.prefill(layout, "c2kv:step0+residual")
    assert len(after - before) == 1 and len({p.name for p in tmp_path.rglob("*.safetensors")} - after) == 1
    # A corrupted C2 file is detected, dropped and extracted again: the same logits, never garbage.
    (path,) = [p for p in tmp_path.rglob("*.safetensors") if p.name in after - before]
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0xFF
    path.write_bytes(bytes(blob))
    fresh = tiny_engine(threads=None, tiers=f"disk:{tmp_path}")
    fresh.cache_chunk(words(30, 90))
    assert torch.equal(fresh.prefill(fresh.build_prompt([cid], words(4, 3)), "c2kv:step0").logits, plain)


def test_c2kv_serves_in_a_batch_like_alone_and_reserves_only_its_rows():
    engine = tiny_engine(threads=None)
    alone, reqs = alone_then_added(engine, "c2kv:step0")
    engine.step()
    prompts = [r.prompt for r in reqs]
    expect = sum(p.segments[0].token_ids.numel() + p.segments[-1].token_ids.numel()
                 + sum(math.ceil(s.token_ids.numel() / 4) for _, s in p.chunk_segments) + 5 for p in prompts)
    assert engine.kv_usage().used_rows == expect
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in reqs] == alone


def test_a_trained_file_serves_under_its_own_variant(tmp_path):
    engine = tiny_engine(threads=None)
    trained = _perturbed_extractor(engine.adapter)
    trained.base_identity = engine.extractors.base_identity
    trained.save(tmp_path / "ex.safetensors")
    step0, loaded = engine.extractors.get("step0"), engine.extractors.get(str(tmp_path / "ex.safetensors"))
    assert loaded.variant != step0.variant  # serving turns grad off; the fingerprint still sees the weights
    cid = engine.cache_chunk(words(20, 93))
    layout = engine.build_prompt([cid], words(4, 5))
    a = engine.prefill(layout, "c2kv:step0").logits
    b = engine.prefill(layout, f"c2kv:{tmp_path / 'ex.safetensors'}").logits
    assert not torch.allclose(a, b)


def test_unknown_extractors_and_a_missing_bundled_one_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHETUNE_WEIGHTS_DIR", str(tmp_path / "weights"))
    engine = tiny_engine(threads=None)
    cid = engine.cache_chunk(words(12, 91))
    layout = engine.build_prompt([cid], words(4, 4))
    with pytest.raises(ExtractorError, match="no bundled c2kv weights"):
        engine.prefill(layout, "c2kv")
    with pytest.raises(ExtractorError, match="no paper c2kv weights .*`make c2kv-paper` builds them"):
        engine.prefill(layout, "c2kv:paper")
    with pytest.raises(ExtractorError, match="not a shipped name"):
        engine.prefill(layout, f"c2kv:{tmp_path / 'missing.safetensors'}")
    with pytest.raises(ValueError, match="one row per 4 tokens"):
        engine.prefill(layout, make_method("c2kv:step0", block=8))


def test_the_paper_extractor_is_built_not_shipped_and_a_server_without_it_answers_400_naming_the_target(
        tmp_path, monkeypatch):
    """c2kv:paper only reproduces the paper's variant (33 MB): the package does not ship it, `make
    c2kv-paper` builds it into the user's weights folder (c2kv.bank.built_dir()), where the bank finds
    it. Without the file the method says how to build it, and the server refuses the request (400)."""
    import httpx

    from cachetune.c2kv.bank import BUNDLED_DIR, built_dir
    from cachetune.config import ServerConfig
    from cachetune.server.app import build_app
    from cachetune.server.http import BackgroundServer

    assert not (BUNDLED_DIR / "paper").exists()  # not in the package (nor in the wheel)
    monkeypatch.delenv("CACHETUNE_WEIGHTS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert built_dir() == tmp_path / "cache" / "cachetune" / "weights"
    monkeypatch.setenv("CACHETUNE_WEIGHTS_DIR", str(tmp_path / "weights"))
    assert built_dir() == tmp_path / "weights"
    engine = tiny_engine(threads=None)
    why = engine.method("c2kv:paper").unavailable(engine.context)
    assert "make c2kv-paper" in why and str(tmp_path / "weights" / "paper") in why
    with BackgroundServer(build_app(engine, ServerConfig())) as url:
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"prompt": words(6, 2), "max_tokens": 2, "method": "c2kv:paper"})
    assert r.status_code == 400, r.text
    assert "make c2kv-paper" in r.json()["error"]["message"]
    # A file the target writes there is what c2kv:paper serves (here the tiny model's own extractor).
    trained = _perturbed_extractor(engine.adapter)
    trained.base_identity = engine.extractors.base_identity
    trained.save(tmp_path / "weights" / "paper" / "tiny.safetensors")
    assert engine.method("c2kv:paper").unavailable(engine.context) is None


def test_an_extractor_names_its_base_model_the_same_in_float32_and_bfloat16():
    import copy

    from cachetune.model.loader import model_fingerprint, weights_identity
    from conftest import build_model

    model = build_model("llama")
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert weights_identity(half) == weights_identity(model)
    assert model_fingerprint(half) != model_fingerprint(model)  # chunk ids still differ per dtype
    assert weights_identity(build_model("llama", seed=1)) != weights_identity(model)


def test_a_request_names_only_shipped_step0_or_configured_extractors_and_the_bank_stays_bounded(tmp_path):
    from cachetune.c2kv.bank import ExtractorBank
    from cachetune.methods import check_request_method

    engine = tiny_engine(threads=None, c2kv_extractor="step0+residual")
    trained = _perturbed_extractor(engine.adapter)
    trained.base_identity = engine.extractors.base_identity
    trained.save(tmp_path / "ex.safetensors")
    for spec in ["c2kv", "c2kv:step0+residual", "c2kv:step0", "c2kv:bundled"]:
        check_request_method(spec, engine.config)
    for spec in [f"c2kv:{tmp_path / 'ex.safetensors'}", f"c2kv:{tmp_path / 'missing.safetensors'}"]:
        with pytest.raises(ValueError, match="may set extractor only to one of 'bundled', 'paper', 'step0'"):
            check_request_method(spec, engine.config)
    # The operator's own file is a configured value: requests may name it.
    own = tiny_engine(threads=None, c2kv_extractor=str(tmp_path / "ex.safetensors"))
    check_request_method(f"c2kv:{tmp_path / 'ex.safetensors'}", own.config)
    # The bank keeps at most max_loaded weights: the least recently used is built again.
    bank = ExtractorBank(engine.adapter, engine.extractors.base_identity, engine.fingerprint, EOS, max_loaded=2)
    first = bank.get("step0")
    bank.get("step0+residual")
    third = bank.get("step0+anchor")
    assert bank.get("step0+anchor") is third and bank.get("step0") is not first
    for bad in [0, 2.5, float("inf"), None, True]:
        with pytest.raises(ValueError, match="max_loaded"):
            ExtractorBank(engine.adapter, "id", "fp", EOS, max_loaded=bad)
