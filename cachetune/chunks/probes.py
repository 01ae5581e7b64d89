"""Probe contexts: fixed text placed before a chunk to see which of its tokens move in context.

A chunk encoded alone differs from the same chunk inside a prompt mostly where the missing context
matters: its first tokens (which, alone, are the attention sink) and tokens that attend far back. The
probe ranker measures that offline: encode the chunk once more after a probe prefix and rank tokens
by how far their K/V move. A probe's own KV is computed once per engine and reused for every chunk,
so probing costs about one extra encode of the chunk's tokens, not of the probe.

A probe is the prompt head a real request puts before its documents (chat template start and system
prompt) followed by one neutral passage. The passages below are written for this purpose: plain
encyclopedic prose on topics unrelated to any dataset, so no chunk is probed with its own content.
Rankings must be a function of the chunk's content alone (the store is content-addressed), which
rules out probing with whatever other chunk happens to be cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachetune.chunks.kv import encode_kv
from cachetune.model.adapter import ModelAdapter

PROBE_PASSAGES = (
    "The bicycle took its familiar shape in the 1880s, when the chain drive to the rear wheel and two "
    "wheels of equal size replaced the tall front wheel of earlier machines. Pneumatic tyres followed a "
    "few years later and made riding on rough roads far more comfortable. Within a decade cycling clubs "
    "had spread across Europe and North America, and the demand for smooth surfaces helped to start the "
    "movement for paved country roads. Many workshops that built bicycles later moved on to motorcycles, "
    "cars and aircraft, carrying over their experience with light frames, ball bearings and gears.",
    "Tides are caused mainly by the gravity of the Moon and, to a lesser degree, the Sun. The ocean on the "
    "side of the Earth facing the Moon is pulled toward it, and the ocean on the far side is left behind, "
    "so most coasts see two high tides and two low tides each lunar day of about twenty-four hours and "
    "fifty minutes. When the Sun and Moon line up, at new and full moon, their effects add and the tidal "
    "range is largest; these are called spring tides. The shape of a coastline and the depth of the sea "
    "floor can make the range far larger in some bays than in the open ocean.",
    "Bread is made by mixing flour with water, salt and a leavening agent, most often yeast. Kneading "
    "develops gluten, a network of proteins that traps the carbon dioxide released as the yeast ferments "
    "sugars, so the dough rises. After shaping and a second rise, the loaf is baked; the heat sets the "
    "crumb, drives off much of the water and browns the crust through reactions between sugars and amino "
    "acids. Sourdough uses a culture of wild yeasts and lactic acid bacteria instead of commercial yeast, "
    "which gives a slower rise and a sour taste that also helps the bread keep longer.",
)


@dataclass
class Probe:
    """A probe prefix's per-layer pre-RoPE K and V [L, P, Hkv, D] at positions 0..P-1."""

    token_ids: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def rows(self) -> torch.Tensor:  # ReusedKV protocol: the probe fills rows 0..P-1
        return torch.arange(self.token_ids.numel(), device=self.keys.device)

    def begin(self, rotate) -> bool:  # ReusedKV protocol: pre-RoPE keys, the forward rotates them
        return False

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index], self.values[index]


class ProbeBank:
    """The probe prefixes of one engine, encoded lazily once each; `after(i, ids)` encodes a chunk behind one."""

    def __init__(self, adapter: ModelAdapter, prefixes: list[torch.Tensor]):
        if not prefixes:
            raise ValueError("a probe bank needs at least one prefix")
        self.adapter = adapter
        self.prefixes = prefixes
        self._probes: dict[int, Probe] = {}

    def __len__(self) -> int:
        return len(self.prefixes)

    def probe(self, index: int) -> Probe:
        if index not in self._probes:
            ids = self.prefixes[index]
            self._probes[index] = Probe(ids, *encode_kv(self.adapter, ids))
        return self._probes[index]

    @torch.no_grad()
    def after(self, index: int, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE K/V [L, N, Hkv, D] of the chunk `token_ids` encoded right after probe `index`."""
        return encode_kv(self.adapter, token_ids, self.probe(index))
