"""The parts of ``benchmarks/decode_profile.py``: arguments, inputs, the instrumented decode, the passes, reports."""
