"""Bundled workloads: digits (data + MLP) and the synthetic CTR task."""
