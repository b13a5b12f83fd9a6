"""Example programs built on hyper_parallel (not installed with the package; run from the repo root)."""
