"""The steps of ``benchmarks/real_targets.py``: fetch, data, labels, train, evaluate, report, pieces."""
