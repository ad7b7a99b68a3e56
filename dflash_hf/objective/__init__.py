"""The training objective of one micro-batch: `DFlashObjective` plans it on the host (`BlockPlan`), computes the
loss (taps -> labels -> blocks -> draft -> loss sums) and normalizes it; the label sources (`labels/`) and losses
(`losses/`) are registries. Public names are imported on first use (`dflash_hf.lazy`)."""

from dflash_hf.lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".dflash_objective": ["BlockPlan", "DFlashObjective"],
        ".labels": ["LABEL_SOURCES", "LabelSource"],
        ".losses": ["LOSSES", "BlockLoss", "MetricSums", "SlotLoss"],
    },
)
