"""`dflash-train`'s data pre-flight, once per process group (docs/PERFORMANCE.md, "Manifest pre-flight").

Rank 0 (or the only process) checks every row of every training and validation source before the target loads
(`data.row_scan`: in parallel for a large file); the other ranks read nothing then and load their target meanwhile.
Once the targets are loaded, :func:`share_data_rows` hands rank 0's results to every rank, whose loaders then open the
sources without reading their rows again (a rank that sees a file otherwise, by path, size or modification time, reads
it itself).
"""

from __future__ import annotations

from dflash_hf.data import BadSamples, open_source
from dflash_hf.data.row_scan import check_rows, remember_scans, remembered_scans
from dflash_hf.data.sources import file_reader


def check_data_rows(data_args) -> None:
    """Every row of the train and eval sources, without audio (call it on rank 0 only), so a malformed row or a
    refused command/url audio source is an error (strict) before the target loads; with --skip_bad_samples true the
    bad rows are found now and counted by the loaders. Strict, every audio file of the (small) validation sets is
    opened too."""
    evals = list((data_args.eval_sources() or {}).values())
    for source in (data_args.train_sources() or []) + evals:
        check_rows(source, file_reader, skip=data_args.skip_bad_samples)
    if not data_args.skip_bad_samples:
        for source in evals:
            for _ in open_source(source, BadSamples(skip=False)):
                pass


def share_data_rows(world_size: int, process_index: int) -> None:
    """Every rank gets rank 0's row checks (a collective: every rank calls it, after its target loaded)."""
    if world_size <= 1:
        return
    import torch.distributed as dist

    payload = [remembered_scans() if process_index == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    if process_index != 0:
        remember_scans(payload[0])


__all__ = ["check_data_rows", "share_data_rows"]
