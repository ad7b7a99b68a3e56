"""Padded (BSHD) collator: cuts -> the batch contract of docs/ARCHITECTURE.md."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import soundfile as sf
import torch
from lhotse import MonoCut
from lhotse.augmentation.resample import Resample
from lhotse.utils import compute_num_samples

from dflash_hf.data.audio_files import (
    REFUSAL_FIX,
    VALUE_FIX,
    ExternalDecoderRefused,
    audio_value_problem,
    load_audio_safely,
)
from dflash_hf.data.bad_samples import (
    SKIP_HINT,
    BadSampleError,
    BadSamples,
    bad_sample_message,
    origin_of,
    sample_label,
)
from dflash_hf.data.conversation import ConversationRenderer, RenderedSample
from dflash_hf.data.generated import splice_rows
from dflash_hf.targets.families.base import TargetFamily
from dflash_hf.targets.families.registry import encode_batch
from dflash_hf.targets.families.whisper_features import is_standard_extractor, with_fast_features

PLAIN_AUDIO_SUFFIXES = (".wav", ".flac")
SKIPPED_KEY = "dflash_skipped"
"""Batch key of the samples the collator skipped (bad audio found when it was read, with ``skip_bad_samples``):
``{sample label: message}``; the loader moves them to its ``BadSamples`` (the collator may run in a worker process).
A batch holding only this key had no usable sample."""


def read_plain_audio(cut) -> np.ndarray | None:
    """``cut.load_audio()`` for a mono cut of one local wav/flac file without transforms, read with soundfile directly
    (lhotse picks its backend for every read, which cost more than reading a short clip); None for any other cut, or
    where the file holds fewer samples than the cut (lhotse's tolerance then decides)."""
    rec = cut.recording if type(cut) is MonoCut else None
    if rec is None or rec.transforms or len(rec.sources) != 1 or rec.num_channels != 1:
        return None
    source = rec.sources[0]
    path = str(source.source)
    if (
        source.type != "file"
        or source.channels != [0]
        or ".tar/" in path
        or not path.lower().endswith(PLAIN_AUDIO_SUFFIXES)
    ):
        return None
    with sf.SoundFile(path) as f:
        if f.samplerate != rec.sampling_rate or f.channels != 1:
            return None
        f.seek(compute_num_samples(cut.start, rec.sampling_rate))
        audio = f.read(frames=cut.num_samples, dtype=np.float32, always_2d=True).T  # [1, samples]
    return audio if audio.shape[1] == cut.num_samples else None


def load_cut_audio(cut, sampling_rate: int) -> np.ndarray:
    """Mono float32 samples of the cut at ``sampling_rate`` (resampled with a windowed-sinc filter if needed). Read
    without running programs unless the cut's source opted in (``audio_files``); samples that are not finite or
    beyond ``audio_files.MAX_ABS_SAMPLE`` are a :class:`BadSampleError` naming the cut."""
    try:
        audio = read_plain_audio(cut)
        audio = load_audio_safely(cut) if audio is None else audio
    except ExternalDecoderRefused as e:
        problem = str(e).split("\n[extra info]")[0]  # lhotse appends the call that failed
        raise BadSampleError(bad_sample_message(cut.id, "audio_filepath", problem, REFUSAL_FIX, origin_of(cut))) from e
    except Exception as e:  # noqa: BLE001 - re-raised with the cut id and the fix
        raise BadSampleError(
            bad_sample_message(
                cut.id,
                "audio_filepath",
                f"decoding failed ({type(e).__name__}: {e})",
                "re-encode the audio as wav or flac",
                origin_of(cut),
            )
        ) from e
    audio = np.asarray(audio, dtype=np.float32)[0]
    problem = audio_value_problem(audio)
    if problem:
        raise BadSampleError(
            bad_sample_message(cut.id, "audio_filepath", f"the audio {problem}", VALUE_FIX, origin_of(cut))
        )
    if cut.sampling_rate != sampling_rate:
        resampler = Resample(orig_freq=cut.sampling_rate, new_freq=sampling_rate)
        audio = resampler(torch.from_numpy(audio)[None]).numpy()[0]
    return audio


def load_audios(cuts: list, sampling_rate: int, bad: BadSamples | None) -> tuple[list, list, dict[str, str]]:
    """``(kept cuts, their audio, {sample label: message} of the skipped ones)``: `load_cut_audio` of each cut; a bad
    one raises (``bad`` None or not skipping) or is left out and named (the caller counts it: ``add_skipped``)."""
    kept, audios, skipped = [], [], {}
    for cut in cuts:
        try:
            audios.append(load_cut_audio(cut, sampling_rate))
        except BadSampleError as e:
            if bad is None:
                raise
            if not bad.skip:
                raise BadSampleError(f"{e} ({SKIP_HINT})") from e
            skipped[sample_label(cut.id, origin_of(cut))] = str(e)
            continue
        kept.append(cut)
    return kept, audios, skipped


def supervision_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, samples: Sequence[RenderedSample]
) -> torch.Tensor:
    """``loss_mask [b, S]``: each row's rendered suffix sits at the end of its real tokens; mark its
    supervised tokens. Raises if the row's trailing ids differ from the separately tokenized suffix."""
    real = attention_mask.bool()
    lengths = torch.tensor([len(sample.suffix_ids) for sample in samples], dtype=torch.long)
    from_end = real.flip(-1).long().cumsum(-1).flip(-1)  # [b, S] 1 at a row's last real token, 2 before it, ...
    tail = real & (from_end <= lengths[:, None])  # the last `len(suffix_ids)` real tokens of each row
    expected = torch.tensor([i for sample in samples for i in sample.suffix_ids], dtype=input_ids.dtype)
    found = input_ids[tail]  # row by row, in position order
    if found.shape != expected.shape or not torch.equal(found, expected) or not lengths.all():
        rows = zip(samples, found.split(tail.sum(-1).tolist()), expected.split(lengths.tolist()))
        sample = next(sample for sample, got, want in rows if not torch.equal(got, want) or not len(want))
        raise ValueError(
            f"cut {sample.cut_id!r}: the assistant turn tokenizes differently inside the conversation than "
            "on its own (a token merges across the generation prompt); the loss mask would be misplaced. "
            "Use a chat template whose generation prompt ends on a token boundary (e.g. a newline)"
        )
    loss_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    loss_mask[tail] = torch.tensor([flag for sample in samples for flag in sample.suffix_supervised], dtype=torch.bool)
    return loss_mask


class PaddedCollator:
    """``__call__(cuts) -> dict``: ``input_ids``, ``attention_mask``, ``loss_mask`` and the family's audio
    kwargs, exactly as the target's processor returns them, padded on ``padding_side``. ``compact_features``: a
    family with a fixed encoder window (``window_frames``: Whisper) gives compact features instead of the window
    (``whisper_features.COMPACT_FEATURES_KEY``; the frozen target expands them), where the extractor's window is
    the encoder's; ``device_features``: the padded waves instead (``AUDIO_WAVES_KEY``; the frozen target computes
    their features), where the extractor is also the standard one of the target's ``num_mel_bins`` and window.
    ``bad``: with skipping on, a cut whose audio turns out bad when read is left out of the batch and named under
    ``SKIPPED_KEY``; otherwise it raises :class:`BadSampleError`."""

    def __init__(
        self,
        processor,
        target_config,
        family: TargetFamily,
        renderer: ConversationRenderer,
        padding_side: str,
        compact_features: bool = False,
        device_features: bool = False,
        bad: BadSamples | None = None,
    ):
        self.bad = bad
        fe = getattr(processor, "feature_extractor", None)
        frames = family.window_frames(target_config)
        window = frames is not None and getattr(fe, "nb_max_frames", None) == frames
        waves = (
            device_features
            and window
            and is_standard_extractor(fe, getattr(target_config, "num_mel_bins", None), frames)
        )
        # Whisper-style extractors compute only the frames that hold audio (bit-identical,
        # dflash_hf.targets.families.whisper_features)
        self.processor = with_fast_features(processor, compact=compact_features and window, waves=waves)
        self.target_config, self.family = target_config, family
        self.renderer, self.padding_side = renderer, padding_side

    def _pad_id(self) -> int:
        tokenizer = self.renderer.tokenizer
        return next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if isinstance(i, int)), 0)

    def __call__(self, cuts) -> dict:
        cuts = list(cuts)
        cuts, audios, skipped = (
            load_audios(cuts, self.family.sampling_rate, self.bad) if self.family.has_audio else (cuts, [], {})
        )
        if not cuts:
            return {SKIPPED_KEY: skipped}
        samples = self.renderer.render_many(cuts)
        batch = encode_batch(
            self.family, self.processor, self.target_config, [s.text for s in samples], audios, self.padding_side
        )
        batch = splice_rows(batch, samples, self.padding_side, self._pad_id())  # generated `label_ids`, if any
        batch["loss_mask"] = supervision_mask(batch["input_ids"], batch["attention_mask"], samples)
        if skipped:
            batch[SKIPPED_KEY] = skipped
        return batch
