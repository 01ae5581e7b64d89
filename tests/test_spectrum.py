"""KV energy by frequency band (paper appendix E.1): the band split checked on known signals."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cachetune.eval.spectrum import energy_by_band, plot_spectrum, run_spectrum
from test_drift import TinyEngine, tiny_examples


def test_energy_fractions_sum_to_one():
    x = torch.randn(97, 3, 8, generator=torch.Generator().manual_seed(0))
    fractions = energy_by_band(x, bands=10)
    assert fractions.shape == (10,)
    assert float(fractions.sum()) == pytest.approx(1.0)
    assert torch.all(fractions >= 0)


def test_constant_signal_has_all_energy_in_the_lowest_band():
    fractions = energy_by_band(torch.full((64, 2, 4), 3.0), bands=10)
    assert float(fractions[0]) == pytest.approx(1.0)
    assert float(fractions[1:].sum()) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("n, freq, band", [(100, 3, 0), (100, 12, 2), (100, 37, 7), (101, 50, 9), (64, 16, 4)])
def test_pure_cosine_lands_in_its_band(n, freq, band):
    # rFFT of N tokens has N//2 + 1 bins; bin f falls in band floor(f * bands / (N//2 + 1)).
    t = torch.arange(n).float()
    x = torch.cos(2 * math.pi * freq * t / n)[:, None].repeat(1, 5)
    fractions = energy_by_band(x, bands=10)
    assert int(fractions.argmax()) == band
    assert float(fractions[band]) == pytest.approx(1.0, abs=1e-5)


def test_fractions_are_shares_of_signal_energy_parseval():
    # DC of 1 plus a cosine of amplitude 1: signal energy N*1 + N/2, so DC holds 2/3.
    n = 50
    t = torch.arange(n).float()
    x = (1 + torch.cos(2 * math.pi * 20 * t / n))[:, None]
    fractions = energy_by_band(x, bands=2)  # 26 bins: DC in band 0, bin 20 in band 1
    assert float(fractions[0]) == pytest.approx(2 / 3, abs=1e-5)


def test_run_spectrum_reports_band_fractions_per_layer(tiny_adapter, tmp_path):
    _, adapter = tiny_adapter("llama")
    report = run_spectrum(TinyEngine(adapter), tiny_examples(2), bands=10, progress=False)
    json.dumps(report)
    assert report["model"] == "tiny-llama" and report["bands"] == 10
    assert report["chunks"] == 4  # the two examples share two of their three documents
    for kind in ("k", "v"):
        assert len(report[f"{kind}_bands"]) == 10
        assert sum(report[f"{kind}_bands"]) == pytest.approx(1.0, abs=1e-5)
        assert len(report[f"{kind}_bands_by_layer"]) == adapter.num_layers
        assert 0.0 <= report[f"{kind}_dc"] <= report[f"{kind}_low20"] <= report[f"{kind}_low_alpha"] <= 1.0
        # Band 1 is 1/10 of the bins; the lowest 20% of bins hold at least as much energy as it does.
        assert report[f"{kind}_low20"] >= report[f"{kind}_bands"][0] - 1e-6
    plot_spectrum(report, tmp_path / "spectrum.png")
    assert (tmp_path / "spectrum.png").read_bytes()[:4] == b"\x89PNG"
