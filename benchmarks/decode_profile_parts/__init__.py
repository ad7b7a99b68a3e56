"""The parts of ``benchmarks/decode_profile.py``: arguments, inputs, the instrumented decode, the passes, reports; and
``benchmarks/decode_ops.py``'s operator counter."""
