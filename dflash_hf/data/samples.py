"""The samples of one target, assembled once: its conversation renderer, the sample validator that checks and counts
each sample with that renderer, and the padded collator that encodes them with it (`SamplePipeline.build`). The
training loader, the evaluation rows and the label generator all build theirs here."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_hf.data.bad_samples import BadSamples
from dflash_hf.data.collator import PaddedCollator
from dflash_hf.data.conversation import ConversationConfig, ConversationRenderer
from dflash_hf.data.sample_checks import SampleValidator
from dflash_hf.settings import LoaderSettings
from dflash_hf.targets.families.base import TargetFamily
from dflash_hf.targets.families.registry import resolve_family


@dataclass
class SamplePipeline:
    """A target's renderer and validator (`build`), and the collators made from them (`collator`)."""

    processor: object
    target_config: object
    family: TargetFamily
    renderer: ConversationRenderer
    validator: SampleValidator

    @classmethod
    def build(
        cls,
        processor,
        target_config,
        family: TargetFamily | str | None = None,
        conversation: ConversationConfig | None = None,
        *,
        bad: BadSamples,
        max_tokens: int | None = None,
        resample_audio: bool = LoaderSettings.resample_audio,
        duration_tolerance: float = LoaderSettings.duration_tolerance,
        mask_token_id: int | None = None,
        max_chars_per_second: float | None = None,
    ) -> SamplePipeline:
        """`family`: a `TargetFamily`, a family name or None (the config's); `bad`: the bad-sample policy and count the
        validator reports to; the rest are `SampleValidator`'s checks (`max_tokens` None: no token budget)."""
        if not isinstance(family, TargetFamily):
            family = resolve_family(target_config, family)
        renderer = ConversationRenderer(processor, family, conversation)
        validator = SampleValidator(
            renderer,
            family,
            target_config,
            max_tokens=max_tokens,
            bad=bad,
            resample_audio=resample_audio,
            duration_tolerance=duration_tolerance,
            mask_token_id=mask_token_id,
            max_chars_per_second=max_chars_per_second,
        )
        return cls(processor, target_config, family, renderer, validator)

    def collator(
        self,
        padding_side: str,
        *,
        compact_features: bool = False,
        device_features: bool = False,
        bad: BadSamples | None = None,
    ) -> PaddedCollator:
        """The padded collator rendering with this pipeline's renderer (`PaddedCollator`: `bad` None raises on audio
        found bad when it is read; the training loader passes the validator's policy, which may skip it)."""
        return PaddedCollator(
            self.processor,
            self.target_config,
            self.family,
            self.renderer,
            padding_side,
            compact_features=compact_features,
            device_features=device_features,
            bad=bad,
        )


__all__ = ["SamplePipeline"]
