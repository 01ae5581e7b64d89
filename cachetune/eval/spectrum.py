"""How a chunk's K/V energy spreads over frequencies along the token axis (paper appendix E.1, Fig. 9).

Per chunk and layer, K (before RoPE, as the store holds it and as `lf` ranks it) and V of the chunk
encoded alone are transformed with an rFFT along tokens. Energy is |X|^2 summed over (heads, dims);
the bins that stand for a +/- frequency pair count twice (Parseval), so the fractions are shares of
the signal's total energy sum |x|^2. The non-redundant spectrum (N//2 + 1 bins, DC first) is cut
into `bands` equal-width bands. Low-share cut-offs keep ceil(share * (N//2 + 1)) bins, exactly the
bins `lf` keeps at alpha = share. The DC share is reported on its own: K and V have large
per-channel means, and that constant alone puts most of the energy in band 0.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm import tqdm

from cachetune.engine.prompt import DOCUMENT_SEPARATOR
from cachetune.eval.datasets import QAExample

LOW_SHARE = 0.2
ALPHA = 0.5


def power_spectrum(x: torch.Tensor) -> torch.Tensor:
    """x [N, ...] -> one-sided energy per frequency bin [N//2 + 1] (float32, channels summed)."""
    n = x.shape[0]
    power = torch.fft.rfft(x.float().reshape(n, -1), dim=0).abs().square().sum(dim=1)  # [F]
    # Bins 1..ceil(N/2)-1 also stand for their negative frequency; DC and (even N) Nyquist do not.
    power[1 : (n + 1) // 2] *= 2
    return power


def _fractions(power: torch.Tensor, bands: int) -> torch.Tensor:
    """Energy share of each of `bands` equal-width bands of the bins of `power` [F]."""
    f = power.numel()
    which = (torch.arange(f) * bands) // f  # [F] band of each bin
    out = torch.zeros(bands).index_add_(0, which, power.cpu())
    return out / out.sum().clamp_min(torch.finfo(torch.float32).tiny)


def _low_share(power: torch.Tensor, share: float) -> float:
    keep = max(1, math.ceil(share * power.numel()))
    return float(power[:keep].sum() / power.sum().clamp_min(torch.finfo(torch.float32).tiny))


def energy_by_band(x: torch.Tensor, bands: int = 10) -> torch.Tensor:
    """x [N, ...] -> energy fraction [bands] per equal-width band of the rFFT along dim 0 (sums to 1)."""
    if bands < 1:
        raise ValueError(f"bands must be >= 1, got {bands}")
    return _fractions(power_spectrum(x), bands)


def _chunk_stats(kv: torch.Tensor, bands: int) -> dict[str, torch.Tensor]:
    """kv [L, N, Hkv, D] -> per layer: band fractions [L, bands], low20, low_alpha, dc shares [L]."""
    powers = [power_spectrum(layer) for layer in kv]
    return {
        "bands": torch.stack([_fractions(p, bands) for p in powers]),
        "low20": torch.tensor([_low_share(p, LOW_SHARE) for p in powers]),
        "low_alpha": torch.tensor([_low_share(p, ALPHA) for p in powers]),
        "dc": torch.tensor([float(p[0] / p.sum()) for p in powers]),
    }


def run_spectrum(engine, examples: list[QAExample], bands: int = 10, progress: bool = True) -> dict:
    """K and V energy by frequency band of every distinct chunk of `examples`, averaged (chunks equal).

    `engine` needs `name`, `adapter`, `cache_chunk(text)` and `chunk(id)`. Keys: `{k,v}_bands`
    [bands] (mean over layers and chunks), `{k,v}_bands_by_layer` [L][bands], `{k,v}_low20`,
    `{k,v}_low_alpha`, `{k,v}_dc` (shares of the lowest 20% / alpha of bins / the DC bin) and their
    per-layer arrays `{...}_by_layer`.
    """
    layers = engine.adapter.num_layers
    seen: set[str] = set()
    stats: dict[str, list[dict[str, torch.Tensor]]] = {"k": [], "v": []}
    for ex in tqdm(examples, desc="spectrum", disable=not progress):
        for doc in ex.documents:
            cid = engine.cache_chunk(doc + DOCUMENT_SEPARATOR)
            if cid in seen:
                continue
            seen.add(cid)
            chunk = engine.chunk(cid)
            idx = torch.arange(chunk.num_tokens)
            pairs = [chunk.load_layer(layer, idx) for layer in range(layers)]
            stats["k"].append(_chunk_stats(torch.stack([k for k, _ in pairs]), bands))
            stats["v"].append(_chunk_stats(torch.stack([v for _, v in pairs]), bands))
    report: dict = {"model": engine.name, "bands": bands, "chunks": len(seen), "low_share": LOW_SHARE,
                    "alpha": ALPHA, "keys": "pre-RoPE, chunk encoded alone"}
    for kind, per_chunk in stats.items():
        for name in ("bands", "low20", "low_alpha", "dc"):
            by_layer = torch.stack([c[name] for c in per_chunk]).mean(0)  # [L, bands] or [L]
            report[f"{kind}_{name}"] = by_layer.mean(0).tolist()
            report[f"{kind}_{name}_by_layer"] = by_layer.tolist()
    return report


def format_spectrum_table(report: dict) -> str:
    """Markdown: K and V energy fraction per band, then the low-frequency and DC shares."""
    n = report["bands"]
    lines = [
        f"model {report['model']}, {report['chunks']} chunks, {report['keys']} keys; energy share per "
        f"band (band 1 = lowest frequencies)",
        "",
        "| | " + " | ".join(str(i + 1) for i in range(n)) + " | lowest 20% | lowest alpha=0.5 | DC |",
        "|---|" + "---|" * (n + 3),
    ]
    for kind in ("k", "v"):
        cells = [f"{x:.3f}" for x in report[f"{kind}_bands"]]
        cells += [f"{report[f'{kind}_{name}']:.3f}" for name in ("low20", "low_alpha", "dc")]
        lines.append(f"| {kind.upper()} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_spectrum(report: dict, path: str | Path) -> None:
    """PNG: K/V energy share by band, and the lowest-20% and DC shares by layer."""
    from cachetune.eval.report import pyplot, save_figure

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = torch.arange(report["bands"]).float()
    left.bar(x - 0.2, report["k_bands"], width=0.4, label="K (pre-RoPE)")
    left.bar(x + 0.2, report["v_bands"], width=0.4, label="V")
    left.set_xticks(x.tolist(), [str(i + 1) for i in range(report["bands"])])
    left.set_yscale("log")
    left.set_xlabel("frequency band (low to high)")
    left.set_ylabel("energy share")
    left.set_title(f"{report['model']}: KV energy by band ({report['chunks']} chunks)")
    left.legend()
    for kind, color in (("k", "tab:blue"), ("v", "tab:orange")):
        right.plot(report[f"{kind}_low20_by_layer"], color=color, label=f"{kind.upper()} lowest 20%")
        right.plot(report[f"{kind}_dc_by_layer"], color=color, linestyle="--", label=f"{kind.upper()} DC only")
    right.set_ylim(0, 1)
    right.set_xlabel("layer")
    right.set_ylabel("energy share")
    right.legend()
    save_figure(fig, path)
