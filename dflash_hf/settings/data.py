"""The settings of the data: how batches are made and samples checked (`BatchSettings`), the data options of
`dflash-train` (`DataSettings`: sources, prompts, audio policy) and the whole set the training loader is built from
(`LoaderSettings`, one object for `dflash_hf.data.build_train_dataloader`). Light: no torch, no transformers."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_hf.settings.checks import Range, Settings, count, setting
from dflash_hf.settings.objective import ObjectiveSettings

PADDING_SIDES = ("left", "right")


@dataclass
class BatchSettings(Settings):
    """How samples are checked and batched: the token budget, the padding side and the bad-sample policy."""

    max_tokens: int = setting(4096, "Token budget of one batch per rank: batch size x longest (audio + text).")
    max_batch_size: int | None = setting(None, "Optional cap on samples per batch.")
    skip_bad_samples: bool = setting(
        False, "False: a bad sample is an error. True: skip it, warn with its id, count it."
    )
    padding_side: str | None = setting(None, "left or right; default: the processor's own padding side.")
    resample_audio: bool = setting(True, "Resample audio to the processor's rate (False: a mismatch is an error).")
    num_buckets: int = setting(10, "Duration buckets of the dynamic bucketing sampler.")
    # read speech reaches about 15 to 20 characters a second (English, spaces included; fewer in scripts with one
    # character a syllable), so 50 leaves a wide margin; a higher rate means a wrong duration or other audio's text
    max_chars_per_second: float = setting(
        50.0,
        "A row whose response has more characters per second of its audio than this is a bad sample "
        "(a wrong duration, or a transcript of other audio; speech reaches about 20). Audio under 0.5 s counts "
        "as 0.5 s. Raise it for responses that are not transcripts; 0 turns the check off.",
    )

    RANGES = {
        "max_tokens": count(1),
        "max_batch_size": count(1, " (or unset)"),
        "num_buckets": count(1),
        "max_chars_per_second": Range(low=0, why=" (0: off)"),
    }

    @classmethod
    def validate(cls, values) -> None:
        super().validate(values)
        if values.padding_side not in (None, *PADDING_SIDES):
            raise ValueError(f"padding_side must be left or right, got {values.padding_side!r}")


@dataclass
class DataSettings(BatchSettings):
    """The data options of a training run: where the speech data comes from, the conversation around it, and which
    audio sources are trusted. Paths are checked by the CLI's pre-flight, not here (building settings reads no
    file)."""

    train_data: list[str] | None = setting(None, "NeMo manifests (.json/.jsonl[.gz]) or lhotse cut files to train on.")
    train_data_weights: list[float] | None = setting(None, "Sampling weight per train_data entry (default: all 1).")
    eval_data: list[str] | None = setting(
        None,
        "Validation sets as NAME=PATH (or PATH; the name is the file stem). Each is reported "
        "as eval_NAME_loss, eval_NAME_tau_est, ...",
    )
    system_prompt: str | None = setting(None, "Optional system turn.")
    prompt: str | None = setting(None, "User text beside the audio when a cut has no `context` field.")
    allow_command_audio_sources: bool = setting(
        False,
        "Allow lhotse cuts whose audio source is of type 'command' (lhotse runs that command in a "
        "shell to read the audio), and decoder programs (ffmpeg through audioread) for audio files libsndfile "
        "cannot read. Only for data you trust (default: refused; audio is read in-process).",
    )
    allow_url_audio_sources: bool = setting(
        False,
        "Allow lhotse cuts whose audio source is of type 'url': the audio is downloaded from that "
        "address while training. Only for cut files you trust (default: refused).",
    )

    RANGES = BatchSettings.RANGES | {
        "train_data_weights": Range(low=0, low_open=True, why=" (one sampling weight per train_data path)")
    }

    @classmethod
    def validate(cls, values) -> None:
        super().validate(values)
        weights, paths = values.train_data_weights, values.train_data or []
        if weights is not None and len(weights) != len(paths):
            raise ValueError(
                f"train_data_weights has {len(weights)} entries for {len(paths)} train_data paths; "
                "give one weight per path"
            )


@dataclass
class LoaderSettings(BatchSettings):
    """Everything the training loader is built from besides its sources, processor, target family and
    conversation: the batch settings, this rank's place, the sampler and what the batches carry."""

    shuffle: bool = setting(True, "Shuffle the samples (each epoch in an order fixed by seed and epoch).")
    seed: int = setting(0, "Seed of the source mixing and the sampler.")
    world_size: int = setting(1, "Data-parallel ranks; each gets its own batches.")
    rank: int = setting(0, "This process's data-parallel rank.")
    drop_last: bool = setting(False, "Drop a last incomplete batch (padded batches).")
    num_workers: int = setting(0, "DataLoader worker processes (0: batches are made in this process).")
    duration_tolerance: float = setting(
        0.05, "Seconds a cut may reach past its audio file's end (rounded manifest durations)."
    )
    buffer_size: int = setting(10000, "Cuts the sampler keeps open to draw batches from.")
    num_cuts_for_bins_estimate: int = setting(
        10000, "Cuts read to estimate the duration buckets' boundaries (padded batches)."
    )
    packing: bool = setting(
        ObjectiveSettings.packing,
        "Packed (THD) batches: one row of documents whose token counts sum to at most max_tokens "
        "(num_buckets, drop_last and num_cuts_for_bins_estimate unused).",
    )
    compact_features: bool = setting(
        False,
        "Whisper batches carry compact features (`PaddedCollator`), which `FrozenTarget.capture` expands; "
        "False: the processor's whole window.",
    )
    device_features: bool = setting(
        False,
        "Whisper batches carry the padded waves, whose features `FrozenTarget.capture` computes on the target's "
        "device, where the extractor is Whisper's standard one.",
    )
    pin_memory: bool = setting(
        False, "Batches in pinned host memory, so that their copy to a GPU does not wait for its stream."
    )
    mask_token_id: int | None = setting(
        None, "The draft's mask token, refused where the template, the processor or a sample uses it."
    )

    RANGES = BatchSettings.RANGES | {"num_workers": count(0), "buffer_size": count(1)}

    @classmethod
    def validate(cls, values) -> None:
        super().validate(values)
        if values.packing and values.max_batch_size is not None:
            raise ValueError(
                "max_batch_size does not apply to packing=True (a packed row is bounded by max_tokens only); "
                "leave it unset"
            )
        if not 0 <= values.rank < values.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={values.rank}, world_size={values.world_size}")


__all__ = ["PADDING_SIDES", "BatchSettings", "DataSettings", "LoaderSettings"]
