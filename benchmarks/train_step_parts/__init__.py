"""The parts of ``benchmarks/train_step.py``: shapes, models, batches, timing, FLOPs, the trainer loop, a case."""
