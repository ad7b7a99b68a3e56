"""Speech data for DFlash training: sources -> lhotse cuts -> conversations -> padded batches.

Trainer entry point (call it from ``DFlashTrainer.get_train_dataloader``)::

    build_train_dataloader(
        sources,                 # DataSource | path | CutSet, or a list of DataSource/paths (mixed by weight)
        processor,               # the target's processor (AutoProcessor) or tokenizer for text targets
        target_config,           # the target's config (picks the family row, audio token id, frame counts)
        settings=None,           # LoaderSettings (dflash_hf.settings): the token budget, max_batch_size, padding
                                 # side, shuffle and seed, world_size and rank, buckets, the bad-sample policy,
                                 # packing, the Whisper feature form, pin_memory, mask_token_id (defaults and help
                                 # there; None: all defaults)
        *,
        family=None,             # TargetFamily | name | None (resolved from target_config.model_type)
        conversation=None,       # ConversationConfig(system_prompt=None, prompt=None, ...)
        **options,               # LoaderSettings fields changed by name, e.g. max_tokens=600, packing=True
    ) -> CutDataLoader

Each batch is the padded (BSHD) batch contract of docs/ARCHITECTURE.md: ``input_ids``, ``attention_mask``,
``loss_mask`` and the family's audio kwargs (``family.audio_kwargs``), on CPU. With ``compact_features=True`` (the
trainer's loaders) a Whisper batch holds ``input_features_compact`` instead of ``input_features``: ``[b, n_mels,
kept]``, the frames that hold audio and one padding frame (``dflash_hf.targets.families.whisper_features``);
``FrozenTarget.capture``
rebuilds the 30 s window on the target's device, bit-identical. With ``device_features=True`` as well (the trainer's
loaders; where the processor's extractor is the standard one of the target's ``num_mel_bins``) it holds
``input_audio_waves`` instead, ``[b, width]`` float32: the clips zero-padded to the samples those frames need, whose
features ``FrozenTarget.capture`` computes on the target's device (bit-identical on the CPU, float rounding on a GPU),
so the loader only reads audio. With ``packing=True`` it is the
packed (THD) contract instead: one row plus ``position_ids``, ``cu_seqlens``, ``max_seqlen``.

The loader is already sharded by rank: hand it to the Trainer as is (do not let ``accelerator.prepare`` re-shard
it). It has no ``len``: train with ``max_steps``. ``loader.set_epoch(epoch)`` reshuffles;
``loader.state_dict()`` / ``loader.load_state_dict(state)`` resume mid-epoch (batches handed out so far, not
the ones prefetched by workers); accelerate's ``skip_first_batches`` also works since iteration is
deterministic. ``loader.bad_samples.num_skipped`` / ``.summary()`` report skipped samples, one per source row (log
it at the end). Sources are scanned line by line when opened, so malformed rows fail (or are counted) before
training; lhotse audio sources of type ``command`` / ``url`` need ``DataSource(allow_command_audio_sources=True)``
/ ``allow_url_audio_sources=True`` (docs/DATA.md). Audio is read in the process (libsndfile); a file only a decoder
program could read needs ``allow_command_audio_sources`` too (``audio_files.py``). Non-finite or absurd samples, and a
control token's text in a row's text, are bad samples (``audio_files.py``, ``user_text.py``).

The names below are imported on first use (``dflash_hf.lazy``).
"""

from dflash_hf.lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".bad_samples": ["BadSampleError", "BadSamples"],
        ".collator": ["PaddedCollator", "load_cut_audio", "supervision_mask"],
        ".conversation": ["ConversationConfig", "ConversationRenderer", "RenderedSample", "cut_to_messages"],
        ".loader": ["CutDataLoader", "TokenBudgetConstraint", "build_train_dataloader", "default_padding_side"],
        ".packing": ["PackingCollator", "PackingSampler", "pack_padded_batch"],
        ".sample_checks": ["SampleValidator"],
        ".sources": ["DataSource", "LhotseCuts", "NemoManifest", "mix_sources", "nemo_line_to_cut", "open_source"],
    },
)
