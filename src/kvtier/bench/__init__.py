"""Benchmarks that print measured values next to raw baselines and targets, and write JSON."""
