"""Dynamic int8 linear layers (model.int8): what a signal pass's weights become with signal_dtype=int8."""

import pytest
import torch
from torch import nn

from conftest import rel_err
from cachetune.model.int8 import DynamicInt8Linear, int8_supported, quantize_linears

pytestmark = pytest.mark.skipif(not int8_supported(torch.device("cpu")), reason="no quantized CPU engine")


@pytest.mark.parametrize("bias", [True, False])
def test_an_int8_linear_matches_its_float_layer_within_8_bit_precision(bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    x = torch.randn(3, 5, 64)
    got = DynamicInt8Linear(linear)(x)
    want = linear(x)
    assert got.shape == want.shape == (3, 5, 48) and got.dtype == torch.float32
    assert rel_err(want, got) < 2e-2
    assert not torch.equal(got, want)


def test_a_token_with_outsized_activations_leaves_the_others_precision_alone():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(6, 64)
    x[0] *= 1000  # an attention sink's hidden state next to ordinary tokens
    got, want = DynamicInt8Linear(linear)(x), linear(x)
    for t in range(6):
        assert rel_err(want[t], got[t]) < 2e-2, t


def test_an_int8_linear_answers_in_its_input_dtype():
    linear = nn.Linear(16, 8)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    got = DynamicInt8Linear(linear)(x)
    assert got.dtype == torch.bfloat16
    assert rel_err(linear(x.float()), got.float()) < 3e-2


def test_an_int8_linear_keeps_a_row_whose_weights_are_all_zero_at_zero():
    linear = nn.Linear(16, 4, bias=False)
    with torch.no_grad():
        linear.weight[1] = 0
    got = DynamicInt8Linear(linear)(torch.randn(7, 16))
    assert torch.isfinite(got).all() and torch.equal(got[:, 1], torch.zeros(7))


def test_quantize_linears_replaces_every_linear_and_leaves_the_rest():
    import copy

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Sequential(nn.Linear(8, 4), nn.ReLU()))
    float_block = copy.deepcopy(block)
    norm = block[1]
    quantize_linears(block)
    assert isinstance(block[0], DynamicInt8Linear) and isinstance(block[2][0], DynamicInt8Linear)
    assert block[1] is norm and isinstance(block[2][1], nn.ReLU)
    x = torch.randn(5, 8)
    got, want = block(x), float_block(x)
    assert got.shape == (5, 4) and rel_err(want, got) < 3e-2 and not torch.equal(got, want)


def test_int8_layers_are_refused_off_the_cpu():
    assert not int8_supported(torch.device("meta"))
    with pytest.raises(ValueError, match="CPU only"):
        DynamicInt8Linear(nn.Linear(4, 4, device="meta"))


def test_an_int8_linear_does_not_saturate_where_products_overflow_int16():
    """Positive activations (8-bit codes near 255) against weights near +-127: each pair of products
    passes int16's range, where a CPU without VNNI (vpmaddubsw) saturates unless inputs take 7 bits."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.sign(torch.randn(64, 256)) * (0.9 + 0.1 * torch.rand(64, 256)))
    x = (torch.rand(12, 256) + 0.5) * torch.logspace(0, 4, 12)[:, None]  # large, all-positive activations
    got, want = DynamicInt8Linear(linear)(x), linear(x)
    for t in range(12):
        assert rel_err(want[t], got[t]) < 2e-2, t
