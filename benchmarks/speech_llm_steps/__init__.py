"""The steps of ``benchmarks/speech_llm.py``: fetch-llm, assemble, train, wer."""
