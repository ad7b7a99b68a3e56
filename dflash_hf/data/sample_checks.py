"""Early validation of cuts (metadata and audio headers only, before any audio is decoded) and the token
count each sample occupies in the decoder (audio positions after expansion + text tokens)."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

from lhotse import CutSet

from dflash_hf.data.audio_files import audio_path_problem
from dflash_hf.data.bad_samples import BadSamples, origin_of, sample_label
from dflash_hf.data.conversation import RENDERED_TEXT_KEY, ConversationRenderer, conversation_key, cut_to_messages
from dflash_hf.data.generated import generated_fields, generated_problem, rate_problem
from dflash_hf.data.sources import make_cut
from dflash_hf.data.user_text import UserTextCheck
from dflash_hf.settings import LoaderSettings
from dflash_hf.targets.families.base import TargetFamily, add_special_tokens_for, audio_token_id, special_prefix
from dflash_hf.targets.mask_token import mask_token_fix, mask_token_role

NUM_TOKENS_KEY = "dflash_num_tokens"
MAX_REMEMBERED_COUNTS = 1 << 19  # about 180 bytes each (95 MB at most); later samples are counted every epoch
MAX_REMEMBERED_TEXT_CHARS = 1 << 25  # rendered conversations kept for later epochs' collation (about 32 MB of text)
COUNT_CHUNK = 64  # cuts read ahead by `ValidatedCuts`, their counts made with one tokenizer call


class SampleValidator:
    """Checks one cut and stores its decoder token count in ``cut.custom["dflash_num_tokens"]``.

    Checks: response text a non-empty string, context / system prompt strings, none of them holding a control token
    or a lone surrogate (``user_text.py``); audio present, a non-empty
    file, mono; offset/duration finite and inside the file (``duration_tolerance`` seconds of slack, for rounded
    manifest durations: the cut is clipped to the file); sampling rate equal to the family's (or resampled when
    ``resample_audio``); token count within ``max_tokens``; a response text no longer than
    ``max_chars_per_second`` characters per second of audio (``json_rows.text_rate_problem``; None: not checked).
    Each failure goes to ``bad`` (error, or counted
    skip), named by the cut id and its source row. ``mask_token_id`` (the draft's): an id the chat template, the
    processor or the target config use is refused when the validator is made, and one a sample's tokens hold when
    that sample is counted (a setting to change, not a bad sample: ``ValueError`` naming the sample)."""

    def __init__(
        self,
        renderer: ConversationRenderer,
        family: TargetFamily,
        target_config,
        *,
        max_tokens: int | None,
        bad: BadSamples,
        resample_audio: bool = LoaderSettings.resample_audio,
        duration_tolerance: float = LoaderSettings.duration_tolerance,
        mask_token_id: int | None = None,
        max_chars_per_second: float | None = None,
    ):
        self.renderer, self.family, self.target_config = renderer, family, target_config
        self.max_chars_per_second = max_chars_per_second
        self.mask_token_id = mask_token_id
        self.max_tokens, self.bad = max_tokens, bad
        self.resample_audio, self.duration_tolerance = resample_audio, duration_tolerance
        self.audio_id = audio_token_id(family, target_config)
        self._counts: dict[bytes, tuple[int, int]] = {}  # token_counts by a digest of their inputs
        self._texts: dict[bytes, str] = {}  # their rendered conversations, as far as the cap allows
        self._text_chars = 0
        self._prefetched: dict[bytes, tuple] = {}  # the last `prefetch_counts` chunk's `_count`s
        self._prefix = special_prefix(renderer.tokenizer)  # found once: finding it tokenizes
        self._user_text = UserTextCheck(renderer.tokenizer)
        if mask_token_id is not None:
            self._check_mask_token_roles()

    def _check_mask_token_roles(self) -> None:
        """The mask token must not be an id the rendered template (a probe conversation), the tokenizer's named
        roles or the target config's ``*_token_id`` fields use."""
        tokenizer = self.renderer.tokenizer
        probe = make_cut("probe", None, 0.0, 1.0, "a", None, {})
        messages = cut_to_messages(probe, self.family, self.renderer.config)
        template_ids = set(self._stream_ids([self.renderer.render_text(messages)])[0])
        problem = mask_token_role(tokenizer, self.mask_token_id, template_ids)
        if problem:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} {problem}, so the draft's mask slots could not be told from it. "
                f"Fix: {mask_token_fix(tokenizer, self.target_config)}"
            )

    def _check_mask_token_use(self, cut, ids: list[int]) -> None:
        if self.mask_token_id is not None and self.mask_token_id in ids:
            tokenizer = self.renderer.tokenizer
            token = tokenizer.convert_ids_to_tokens(self.mask_token_id)
            raise ValueError(
                f"mask_token_id={self.mask_token_id} ({token!r}) occurs in the tokens of sample "
                f"{sample_label(cut.id, origin_of(cut))} (its text, context or system prompt), so the draft's mask "
                f"slots could not be told from the data. Fix: {mask_token_fix(tokenizer, self.target_config)}"
            )

    def _report(self, cut, field: str, problem: str, fix: str) -> None:
        self.bad.report(cut.id, field, problem, fix, origin=origin_of(cut))

    def __call__(self, cut):
        if not self._check_text(cut):
            return None
        cut = self.check_audio(cut)
        if cut is None:
            return None
        (text_tokens, audio_positions), saved = self._counts_and_text(cut)
        num_tokens = text_tokens + audio_positions
        limit = self.family.max_positions(self.target_config)
        if limit is not None and num_tokens > limit:
            self._report(
                cut,
                "text",
                f"the sample needs {num_tokens} decoder positions, more than the target's {limit}",
                "shorten or split the transcript (or drop the sample)",
            )
            return None
        if self.max_tokens is not None and num_tokens > self.max_tokens:
            self._report_too_long(cut, text_tokens, audio_positions)
            return None
        # after the budget (a text too long for both is named by its token count); not for a truncated generated row
        if self.family.has_audio:
            problem = rate_problem(cut.custom or {}, cut.supervisions[0].text, cut.duration, self.max_chars_per_second)
            if problem:
                self._report(cut, *problem)
                return None
        cut.custom = dict(cut.custom or {})
        cut.custom[NUM_TOKENS_KEY] = num_tokens
        cut.custom.pop(RENDERED_TEXT_KEY, None)
        if saved is not None:  # rendered to count it: the collation takes it instead of rendering again
            cut.custom[RENDERED_TEXT_KEY] = saved
        return cut

    def check_audio(self, cut):
        """The audio checks and the family's own (Whisper: language, one audio window) without the text and token
        checks: the cut (clipped to its file where it overran by less than the tolerance), or None when reported.
        What `dflash-generate-labels` checks (a row's text is its reference there, not the response)."""
        if self.family.has_audio:
            cut = self._check_audio(cut)
            if cut is None:
                return None
        problem = self.family.sample_problem(self.target_config, self.renderer.tokenizer, cut)
        if problem:
            self._report(cut, *problem)
            return None
        return cut

    def _check_text(self, cut) -> bool:
        """The response, context and system prompt are strings; the response is not empty."""
        problem = self._text_problem(cut)
        if problem:
            self._report(cut, *problem)
        return problem is None

    def _text_problem(self, cut) -> tuple[str, str, str] | None:
        """``(field, problem, fix)`` of `_check_text`, or None."""
        if not cut.supervisions:
            return "text", "the cut has no supervision", "give every cut a supervision with the text"
        text = cut.supervisions[0].text
        if text is not None and not isinstance(text, str):
            return (
                "text",
                f"is not a string ({type(text).__name__} {text!r:.40})",
                "write the response text as a string",
            )
        if text is None or not text.strip():
            return "text", "the response text is empty", "remove the sample or fill in 'text'"
        config = self.renderer.config
        texts = [("text", text)]
        for key in (config.context_key, config.system_prompt_key):
            value = (cut.custom or {}).get(key)
            if value is not None and not isinstance(value, str):
                return (
                    key,
                    f"is not a string ({type(value).__name__} {value!r:.40})",
                    f"write '{key}' as a string, or leave it out",
                )
            if value is not None:
                texts.append((key, value))
        found = next(filter(None, (self._user_text.problem(key, value) for key, value in texts)), None)
        return found or generated_problem(cut, self.renderer.tokenizer, text, self.audio_id)

    def _report_too_long(self, cut, text_tokens: int, audio_positions: int) -> None:
        """Blame the part that needs more tokens: the rendered text or the audio (``duration``)."""
        field = "text" if text_tokens >= audio_positions else "duration"
        audio = f" + {audio_positions} audio positions for {cut.duration:.2f} s" if self.family.has_audio else ""
        shorten = "shorten the text" if field == "text" else "split the audio into shorter cuts"
        self._report(
            cut,
            field,
            f"the sample needs {text_tokens + audio_positions} decoder tokens ({text_tokens} "
            f"rendered text tokens{audio}), more than the batch budget max_tokens={self.max_tokens}",
            f"{shorten}, or raise --max_tokens (--packing_max_tokens with --packing true)",
        )

    def _check_audio(self, cut):
        report = functools.partial(self._report, cut)
        rec = cut.recording
        if rec is None:
            report("audio_filepath", "the cut has no audio", "give every sample an audio file")
            return None
        for source in rec.sources:
            problem = audio_path_problem(Path(source.source)) if source.type == "file" else None
            if problem:
                report("audio_filepath", problem, "point it at an audio file")
                return None
        if rec.num_samples <= 0 or rec.duration <= 0:
            report(
                "audio_filepath",
                f"audio of recording {rec.id!r} has no samples (an empty or header-only file)",
                "replace the file or remove the sample",
            )
            return None
        if rec.num_channels != 1:
            report(
                "audio_filepath",
                f"audio has {rec.num_channels} channels, targets take mono",
                "downmix the file to mono",
            )
            return None
        if not math.isfinite(cut.start) or cut.start < 0 or cut.start >= rec.duration:
            report(
                "offset",
                f"offset {cut.start} s is outside the {rec.duration:.3f} s file",
                "fix 'offset' (seconds from the start of the file)",
            )
            return None
        if not math.isfinite(cut.duration) or cut.duration <= 0:
            report("duration", f"duration {cut.duration} s is not a positive number", "fix 'duration'")
            return None
        overrun = cut.start + cut.duration - rec.duration
        if overrun > self.duration_tolerance:
            report(
                "duration",
                f"offset + duration = {cut.start + cut.duration:.3f} s runs past the end "
                f"of the {rec.duration:.3f} s file",
                "fix 'duration'/'offset' to lie inside the audio",
            )
            return None
        if overrun > 0:
            cut = cut.truncate(duration=rec.duration - cut.start, preserve_id=True)  # the id names its row
        if rec.sampling_rate != self.family.sampling_rate and not self.resample_audio:
            report(
                "sampling_rate",
                f"audio is {rec.sampling_rate} Hz, the target takes {self.family.sampling_rate} Hz",
                f"resample the file to {self.family.sampling_rate} Hz or pass --resample_audio true",
            )
            return None
        return cut

    def token_counts(self, cut) -> tuple[int, int]:
        """``(text tokens, audio positions)`` of the rendered sample in the decoder (audio after expansion).
        Remembered by what decides them (the conversation and the duration), so later epochs do not render and
        tokenize again: the sampler runs this in the loader's main process, beside the training step."""
        return self._counts_and_text(cut)[0]

    def _counts_and_text(self, cut) -> tuple[tuple[int, int], tuple[bytes, str] | None]:
        """`token_counts` and `(conversation_key, the rendered text they count)` (`RENDERED_TEXT_KEY`): made now, or
        remembered with the counts (None past `MAX_REMEMBERED_TEXT_CHARS`: the collation renders it)."""
        messages, key = conversation_key(cut, self.family, self.renderer.config)
        counts = self._counts.get(key)
        if counts is not None:
            text = self._texts.get(key)
            return counts, None if text is None else (key, text)
        counts, text, ids = self._prefetched.get(key) or self._count([cut], [messages], [None])[0]
        self._check_mask_token_use(cut, ids)
        if len(self._counts) < MAX_REMEMBERED_COUNTS:
            self._counts[key] = counts
            if self._text_chars + len(text) <= MAX_REMEMBERED_TEXT_CHARS:
                self._texts[key] = text
                self._text_chars += len(text)
        return counts, (key, text)

    def prefetch_counts(self, cuts) -> None:
        """Count the samples of `cuts` not counted yet with one tokenizer call (its per-call overhead was most of
        a count), for `token_counts` to find. Only cuts that can be counted are (`_countable`); the checks and their
        reports stay with each cut's validation."""
        todo: dict[bytes, tuple] = {}
        for cut in filter(self._countable, cuts):
            messages, key = conversation_key(cut, self.family, self.renderer.config)
            if key in self._counts or key in todo:
                continue
            try:
                text = self.renderer.render_conversation(messages, generated_fields(cut)[1])
            except Exception:  # noqa: BLE001 - left to the cut's own validation, which raises or reports in order
                continue
            todo[key] = (cut, messages, text)
        self._prefetched = dict(zip(todo, self._count(*zip(*todo.values())))) if todo else {}

    def _countable(self, cut) -> bool:
        """Whether `cut` can be rendered and counted: string texts and, for audio, a usable duration. The family's
        own checks are left to `__call__` (a cut they refuse is at worst counted for nothing; one whose render raises
        is skipped in `prefetch_counts`)."""
        if self._text_problem(cut):
            return False
        return not self.family.has_audio or (math.isfinite(cut.duration) and cut.duration > 0)

    def _count(self, cuts, conversations, texts) -> list[tuple[tuple[int, int], str, list[int]]]:
        """`(token_counts, rendered text, the token ids of its stream)` of each cut's conversation (rendered here where
        its text is None). A cut with `label_ids` (`generated.py`) is counted with those ids for its response."""
        texts = [
            self.renderer.render_conversation(m, generated_fields(c)[1]) if t is None else t
            for c, m, t in zip(cuts, conversations, texts)
        ]
        out = []
        for cut, row_ids, text in zip(cuts, self._stream_ids(texts), texts):
            if generated_fields(cut)[0] is not None:
                row_ids = self._with_label_ids(cut, row_ids)
            out.append((self._split_count(row_ids, cut.duration), text, row_ids))
        return out

    def _with_label_ids(self, cut, ids: list[int]) -> list[int]:
        """The stream `ids` with the response's tokens replaced by the cut's `label_ids`, as the collation does
        (`RenderedSample.text_suffix_ids`)."""
        sample = self.renderer.render(cut)
        if sample.text_suffix_ids is None:
            return ids
        return ids[: len(ids) - len(sample.text_suffix_ids)] + sample.suffix_ids

    def _stream_ids(self, texts: list[str]) -> list[list[int]]:
        """The token ids of rendered texts as the collation makes them, tokenized together (a fast tokenizer
        tokenizes each text of a batch on its own: the same ids as one call a text)."""
        tokenizer = self.renderer.tokenizer
        if self.family.overrides("stream_ids"):  # the family's own tokenization of its stream (as its encode)
            ids = [self.family.stream_ids(tokenizer, text) for text in texts]
        else:
            ids = [None] * len(texts)
            for special in (True, False):  # as the collation adds them: not where a text holds the prefix already
                rows = [i for i, text in enumerate(texts) if add_special_tokens_for(self._prefix, [text]) == special]
                if rows:
                    found = tokenizer([texts[i] for i in rows], add_special_tokens=special)["input_ids"]
                    for i, row_ids in zip(rows, found):
                        ids[i] = row_ids
        return ids

    def _split_count(self, ids: list[int], duration: float) -> tuple[int, int]:
        if not self.family.has_audio:
            return len(ids), 0
        n_placeholders = sum(1 for i in ids if i == self.audio_id)
        num_samples = round(duration * self.family.sampling_rate)
        return len(ids) - n_placeholders, n_placeholders * self.family.audio_tokens(self.target_config, num_samples)

    def count_tokens(self, cut) -> int:
        """Decoder positions of the rendered sample: text tokens + audio positions after expansion."""
        return sum(self.token_counts(cut))


class ValidatedCuts:
    """Lazy, re-iterable: the cuts of ``cuts`` that pass ``validator`` (with token counts attached)."""

    def __init__(self, cuts: Iterable, validator: SampleValidator):
        self.cuts, self.validator = cuts, validator

    def __iter__(self) -> Iterator:
        cuts = iter(self.cuts)
        while chunk := list(itertools.islice(cuts, COUNT_CHUNK)):
            self.validator.prefetch_counts(chunk)
            for cut in chunk:
                checked = self.validator(cut)
                if checked is not None:
                    yield checked


def validated_cutset(cuts: Iterable, validator: SampleValidator) -> CutSet:
    return CutSet(ValidatedCuts(cuts, validator))
