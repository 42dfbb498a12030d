"""Experiments and profiles: one-off A/Bs, GPU profiles and the seed experiment, apart from the suite
(splitserve-bench and the one script per number that docs/ states)."""
