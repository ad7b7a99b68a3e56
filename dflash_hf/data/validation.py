"""Early validation of cuts (metadata and audio headers only, before any audio is decoded) and the token
count each sample occupies in the decoder (audio positions after expansion + text tokens)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from lhotse import CutSet

from dflash_hf.data.bad_samples import BadSamples
from dflash_hf.data.conversation import ConversationRenderer, cut_to_messages
from dflash_hf.families import TargetFamily, _add_special_tokens, audio_token_id

NUM_TOKENS_KEY = "dflash_num_tokens"


class SampleValidator:
    """Checks one cut and stores its decoder token count in ``cut.custom["dflash_num_tokens"]``.

    Checks: non-empty response text; audio present, file existing, mono; offset/duration inside the file
    (``duration_tolerance`` seconds of slack, for rounded manifest durations: the cut is clipped to the file);
    sampling rate equal to the family's (or resampled when ``resample_audio``); token count within
    ``max_tokens``. Each failure goes to ``bad`` (error, or counted skip)."""

    def __init__(self, renderer: ConversationRenderer, family: TargetFamily, target_config, *,
                 max_tokens: int | None, bad: BadSamples, resample_audio: bool = True,
                 duration_tolerance: float = 0.05):
        self.renderer, self.family, self.target_config = renderer, family, target_config
        self.max_tokens, self.bad = max_tokens, bad
        self.resample_audio, self.duration_tolerance = resample_audio, duration_tolerance
        self.audio_id = audio_token_id(family, target_config)

    def __call__(self, cut):
        report = self.bad.report
        if not cut.supervisions:
            report(cut.id, "text", "the cut has no supervision", "give every cut a supervision with the text")
            return None
        text = cut.supervisions[0].text
        if text is None or not str(text).strip():
            report(cut.id, "text", "the response text is empty", "remove the sample or fill in 'text'")
            return None
        if self.family.has_audio:
            cut = self._check_audio(cut)
            if cut is None:
                return None
        check = self.family.sample_problem  # the family's own checks (Whisper: language, one audio window)
        problem = check(self.target_config, self.renderer.tokenizer, cut) if check else None
        if problem:
            report(cut.id, *problem)
            return None
        num_tokens = self.count_tokens(cut)
        limit = self.family.max_positions(self.target_config) if self.family.max_positions else None
        if limit is not None and num_tokens > limit:
            report(cut.id, "text", f"the sample needs {num_tokens} decoder positions, more than the target's "
                   f"{limit}", "shorten or split the transcript (or drop the sample)")
            return None
        if self.max_tokens is not None and num_tokens > self.max_tokens:
            report(cut.id, "duration", f"the sample needs {num_tokens} decoder tokens (audio {cut.duration:.2f} s "
                   f"+ text), more than max_tokens={self.max_tokens}",
                   "raise max_tokens, or split / drop the long sample")
            return None
        cut.custom = dict(cut.custom or {})
        cut.custom[NUM_TOKENS_KEY] = num_tokens
        return cut

    def _check_audio(self, cut):
        report = self.bad.report
        rec = cut.recording
        if rec is None:
            report(cut.id, "audio_filepath", "the cut has no audio", "give every sample an audio file")
            return None
        for source in rec.sources:
            if source.type == "file" and not Path(source.source).is_file():
                report(cut.id, "audio_filepath", f"audio file {source.source!r} does not exist", "fix the path")
                return None
        if rec.num_channels != 1:
            report(cut.id, "audio_filepath", f"audio has {rec.num_channels} channels, targets take mono",
                   "downmix the file to mono")
            return None
        if cut.start < 0 or cut.start >= rec.duration:
            report(cut.id, "offset", f"offset {cut.start} s is outside the {rec.duration:.3f} s file",
                   "fix 'offset' (seconds from the start of the file)")
            return None
        if cut.duration <= 0:
            report(cut.id, "duration", f"duration {cut.duration} s is not positive", "fix 'duration'")
            return None
        overrun = cut.start + cut.duration - rec.duration
        if overrun > self.duration_tolerance:
            report(cut.id, "duration", f"offset + duration = {cut.start + cut.duration:.3f} s runs past the end "
                   f"of the {rec.duration:.3f} s file", "fix 'duration'/'offset' to lie inside the audio")
            return None
        if overrun > 0:
            cut = cut.truncate(duration=rec.duration - cut.start)
        if rec.sampling_rate != self.family.sampling_rate and not self.resample_audio:
            report(cut.id, "sampling_rate", f"audio is {rec.sampling_rate} Hz, the target takes "
                   f"{self.family.sampling_rate} Hz", f"resample the file to {self.family.sampling_rate} Hz or "
                   "pass resample_audio=True")
            return None
        return cut

    def count_tokens(self, cut) -> int:
        """Decoder positions of the rendered sample: text tokens + audio positions after expansion."""
        tokenizer = self.renderer.tokenizer
        text = self.renderer.render_text(cut_to_messages(cut, self.family, self.renderer.config))
        ids = tokenizer(text, add_special_tokens=_add_special_tokens(tokenizer, [text]))["input_ids"]
        if not self.family.has_audio:
            return len(ids)
        n_placeholders = sum(1 for i in ids if i == self.audio_id)
        num_samples = round(cut.duration * self.family.sampling_rate)
        return len(ids) - n_placeholders + n_placeholders * self.family.audio_tokens(self.target_config,
                                                                                         num_samples)


class ValidatedCuts:
    """Lazy, re-iterable: the cuts of ``cuts`` that pass ``validator`` (with token counts attached)."""

    def __init__(self, cuts: Iterable, validator: SampleValidator):
        self.cuts, self.validator = cuts, validator

    def __iter__(self) -> Iterator:
        for cut in self.cuts:
            checked = self.validator(cut)
            if checked is not None:
                yield checked


def validated_cutset(cuts: Iterable, validator: SampleValidator) -> CutSet:
    return CutSet(ValidatedCuts(cuts, validator))
