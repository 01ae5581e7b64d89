"""Dynamic int8 linear layers for approximate passes on a CPU (a selection signal's read of the question).

A signal pass runs a few dozen tokens through many layers, so its time goes to the weight matrices.
With int8 weights (one scale per output row) and each call's input quantized on the fly, PyTorch's
oneDNN kernels (VNNI / AMX-INT8) do those products 1.4-3x faster than bfloat16 on an AMX CPU in
isolation, though a whole Qwen-1.5B request gained less than its noise (docs/results.md,
selection); weight-only int8 kernels, made for one-token decoding, are 4x slower than
bfloat16 at this many tokens. The kernels quantize their input with one scale for the whole matrix,
so each token is first scaled to the same range: one token with outsized activations (a delimiter,
an attention sink) would otherwise take the other tokens' precision. Output in the input's dtype.
CPU only: the quantized kernels exist nowhere else.

Without VNNI (an AVX2-only or plain AVX512 CPU) both oneDNN and FBGEMM multiply u8 inputs by s8
weights with vpmaddubsw, which adds each pair of products in int16 and saturates there: 8-bit inputs
(up to 255) times weights near 127 overflow, and on AVX2 an output was measured 16-30% of its range
off (tests/test_int8.py). There the input is quantized to 7 bits (reduce_range), whose pairs fit;
with VNNI (vpdpbusd, AMX) products add in int32 and the input keeps its 8 bits.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn


def int8_supported(device: torch.device) -> bool:
    """Whether dynamic int8 linear kernels run on `device` (a CPU with a quantized engine)."""
    engines = torch.backends.quantized.supported_engines
    return device.type == "cpu" and any(e in engines for e in ("onednn", "fbgemm", "x86"))


def int8_needs_reduce_range(engine: str) -> bool:
    """Whether `engine`'s dynamic int8 kernels need 7-bit inputs on this CPU: FBGEMM's always did
    here; oneDNN's where the CPU lacks VNNI (AVX512-VNNI or AMX-INT8), so its int16 pair sums
    would saturate. AVX-VNNI alone (256-bit) is not counted: whether a kernel uses it is unknown."""
    if engine != "onednn":
        return True
    try:
        found = dict(torch.cpu.get_capabilities())
    except AttributeError:  # a torch without the capability table: assume no VNNI, the safe side
        return True
    return not (found.get("avx512_vnni", False) or found.get("amx_int8", False))


@contextlib.contextmanager
def _engine(name: str):
    """The quantized engine set to `name` while weights are packed (packed weights keep their engine)."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


class DynamicInt8Linear(nn.Module):
    """A copy of `linear` with int8 weights: y = x W^T + b, each token of the input quantized to 8
    bits per call (its own scale). oneDNN where PyTorch has it; else FBGEMM. Inputs take 7 bits
    (reduce_range) where the kernels would saturate with 8 (int8_needs_reduce_range)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if not int8_supported(linear.weight.device):
            raise ValueError(f"int8 linear layers run on a CPU only, not on {linear.weight.device}")
        engines = torch.backends.quantized.supported_engines
        self.engine = "onednn" if "onednn" in engines else "fbgemm" if "fbgemm" in engines else "x86"
        self.reduce_range = int8_needs_reduce_range(self.engine)
        self.out_features = linear.out_features
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # [out]: one per output row
        # The bias is added after the per-token rescale, so it is kept out of the packed weights.
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        with warnings.catch_warnings(), _engine(self.engine):
            warnings.simplefilter("ignore")  # quantized tensors are deprecated in name; the pinned torch has them
            zero = torch.zeros(weight.shape[0], dtype=torch.long)
            qweight = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()                          # [T, in]
        norm = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)        # [T, 1]: each token's range
        y = torch.ops.quantized.linear_dynamic(flat / norm, self.packed, self.reduce_range) * norm  # [T, out]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


def quantize_linears(module: nn.Module) -> nn.Module:
    """`module` with every nn.Linear inside replaced by a DynamicInt8Linear copy (in place)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, DynamicInt8Linear(child))
        else:
            quantize_linears(child)
    return module
