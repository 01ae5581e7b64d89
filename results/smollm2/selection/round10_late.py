"""Control for the `focus` allocation (issue 16, sixteenth session): share the rest of the budget among
chunks by prompt order (chunk i weighs i + 0.5, so later chunks get more) instead of by the question's
attention mass, with everything else as in `focus`. Run from the repository root with
`scripts/selection_kl.py`'s arguments; the rows it writes are named `focus` but mean "by order".
"""

import sys
from pathlib import Path

import cachetune.methods.allocation as allocation

by_mass = allocation.weighted_quotas


def by_order(weights: list[float], caps: list[int], budget: int) -> list[int]:
    return by_mass([i + 0.5 for i in range(len(caps))], caps, budget)


allocation.weighted_quotas = by_order  # allocate() looks the name up in its module at each call
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import selection_kl  # noqa: E402

if __name__ == "__main__":
    selection_kl.main()
