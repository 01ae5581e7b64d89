"""Hardware-aware choice of the recompute ratio: profile the machine, model the cost, search."""
