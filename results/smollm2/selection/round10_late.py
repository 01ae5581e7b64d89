"""Experiment: `focus` with chunk weights by prompt order (later chunks more) instead of the signal's mass."""
import sys
import cachetune.methods.allocation as A
_orig = A.weighted_quotas
A.weighted_quotas = lambda weights, caps, budget: _orig([i + 0.5 for i in range(len(caps))], caps, budget)
sys.path.insert(0, "scripts")
import selection_kl
sys.argv = ["selection_kl.py", *sys.argv[1:]]
selection_kl.main() if hasattr(selection_kl, "main") else None
