"""The parts of ``benchmarks/vllm_parity.py``: arguments, requests, the vLLM engines, dflash_hf's side, comparison."""
