"""The options of `dflash-generate-labels` (`LabelSettings`): the target, the manifest it labels and the new manifest,
how it decodes, and the part of the manifest one process labels. The checks of the files they name are
`dflash_hf.data.label_manifest.check_label_inputs` (run before the target loads). Light: no torch, no transformers."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_hf.settings.data import DataSettings

LABEL_DTYPES = ("float32", "bfloat16", "float16")
# the fields a labelled line holds for training and for resuming (`data.generated`, `data.label_rows`): where the
# original text is kept must be none of them, or the output would overwrite its own row
LINE_FIELDS = (
    "text",
    "id",
    "audio_filepath",
    "offset",
    "duration",
    "lang",
    "context",
    "system_prompt",
    "label_ids",
    "truncated",
)


@dataclass
class LabelSettings:
    """The options of `dflash-generate-labels`."""

    model: str = field(metadata={"help": "target model directory (or hub id already in the local cache)"})
    manifest: str = field(metadata={"help": "input NeMo manifest (JSON lines)"})
    output: str = field(metadata={"help": "output manifest; appended to and resumed if it exists"})
    family: str | None = field(default=None, metadata={"help": "target family override (see docs/DATA.md)"})
    batch_size: int = field(default=8, metadata={"help": "utterances per generate() call"})
    max_new_tokens: int = field(default=256)
    system_prompt: str | None = field(default=None)
    prompt: str | None = field(default=None, metadata={"help": "default user text (a line's context wins)"})
    reference_key: str = field(default="reference_text", metadata={"help": "where the original text is kept"})
    skip_bad_samples: bool = field(default=DataSettings.skip_bad_samples)
    allow_command_audio_sources: bool = field(
        default=DataSettings.allow_command_audio_sources,
        metadata={
            "help": "let decoder programs (ffmpeg through audioread) read audio files libsndfile cannot; only for "
            "data you trust (default: such a file is a bad sample)"
        },
    )
    device: str = field(default="cpu")
    prefetch: bool = field(
        default=True,
        metadata={
            "help": "read the next batch's audio and make its features in a "
            "background thread while the target decodes this one"
        },
    )
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    num_shards: int = field(
        default=1,
        metadata={
            "help": "split the manifest's lines into this many contiguous parts, one per process (e.g. one per GPU)"
        },
    )
    shard_index: int = field(
        default=0,
        metadata={
            "help": "the part this process labels (0-based); concatenating the "
            "outputs in shard order keeps the manifest's order"
        },
    )

    def __post_init__(self):
        for name in ("batch_size", "max_new_tokens", "num_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"field '{name}' must be >= 1, got {getattr(self, name)}")
        if self.dtype not in LABEL_DTYPES:
            raise ValueError(f"field 'dtype' must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not self.reference_key or self.reference_key in LINE_FIELDS:
            raise ValueError(
                f"field 'reference_key' must name a new field of the output line, got {self.reference_key!r}: "
                f"the line already holds {', '.join(LINE_FIELDS)}; keep the default 'reference_text' or pick another "
                "name"
            )

    def check_shard(self) -> None:
        """`shard_index` numbers one of the `num_shards` parts."""
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(
                f"field 'shard_index' must be in [0, num_shards={self.num_shards}), got "
                f"{self.shard_index}: number the parts 0 .. num_shards - 1"
            )


__all__ = ["LABEL_DTYPES", "LabelSettings"]
