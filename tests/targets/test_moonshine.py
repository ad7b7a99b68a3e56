"""Moonshine, a second encoder-decoder speech target through Whisper's row kind: the raw waveform goes to the encoder
with its padding mask, the start token is context, the transcript and end token are supervised, decoding is
lossless against Moonshine's own `generate`, and the CLI verbs (train, eval, generate-labels) run on it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import MoonshineConfig, MoonshineForConditionalGeneration, Wav2Vec2FeatureExtractor, Wav2Vec2Processor

from dflash_hf import DFlashConfig, DFlashDraftModel, speculative_generate
from dflash_hf.data import ConversationConfig, build_train_dataloader, open_source
from dflash_hf.generation.speculative import dflash_custom_generate
from dflash_hf.targets.families.registry import FAMILIES, generate_kwargs
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny

BLOCK = 4


def build_moonshine(seed: int = 0):
    tok = tiny.build_tokenizer()
    tok.bos_token = "<|im_start|>"  # Moonshine's decoder starts from the tokenizer's bos_token
    config = MoonshineConfig(
        vocab_size=len(tok) + 8,
        hidden_size=32,
        intermediate_size=64,
        encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=4,
        encoder_num_attention_heads=2,
        decoder_num_attention_heads=2,
        max_position_embeddings=128,
        decoder_start_token_id=tok.bos_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = tiny.sharpen(MoonshineForConditionalGeneration(config), seed=seed + 1)
    extractor = Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=False, return_attention_mask=True
    )
    return model.eval(), Wav2Vec2Processor(feature_extractor=extractor, tokenizer=tok)


@pytest.fixture(scope="module")
def moonshine():
    return build_moonshine()


def _mask_id(processor) -> int:
    return processor.tokenizer.convert_tokens_to_ids(tiny.MASK_TOKEN)


def _draft(target: FrozenTarget, processor) -> DFlashDraftModel:
    torch.manual_seed(0)
    cfg = DFlashConfig.from_target_config(
        target.text_config, mask_token_id=_mask_id(processor), num_hidden_layers=1, block_size=BLOCK
    )
    return DFlashDraftModel(cfg).eval()


def _audio(seed: int, seconds: float) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)


@pytest.mark.slow  # 9 s on 2 busy cores
def test_the_start_token_is_context_and_the_transcript_and_end_token_are_supervised(moonshine, tmp_path):
    model, processor = moonshine
    target = FrozenTarget(model)
    assert target.family.name == "moonshine" and target.num_layers == 4 and target.encoder_hidden_size == 32
    assert target.text_config.num_hidden_layers == 4 and target.text_config.hidden_size == 32
    manifest = tiny.synthesize_speech(tmp_path / "speech", 4, seed=0)
    loader = build_train_dataloader(
        manifest,
        processor,
        model.config,
        family=target.family,
        max_tokens=100_000,
        num_buckets=1,
        shuffle=False,
        padding_side="right",
    )
    batch = next(iter(loader))
    rows = [json.loads(x) for x in manifest.read_text().splitlines()]
    tok = processor.tokenizer
    assert batch["input_values"].shape[0] == batch["input_ids"].shape[0] >= 2
    for i, ids in enumerate(batch["input_ids"]):
        n = int(batch["attention_mask"][i].sum())
        assert ids[0] == model.config.decoder_start_token_id and not batch["loss_mask"][i, 0]
        assert batch["loss_mask"][i, 1:n].all() and not batch["loss_mask"][i, n:].any()
    texts = sorted(
        tok.decode(ids[1 : int(m.sum())], skip_special_tokens=False)
        for ids, m in zip(batch["input_ids"], batch["attention_mask"])
    )
    assert set(texts) <= {f"{r['text']}{tok.eos_token}" for r in rows} and len(set(texts)) == len(texts)
    # generate's keywords: the waveform's padding mask goes to the encoder as attention_mask, the decoder's mask
    # as decoder_attention_mask
    kwargs = generate_kwargs(target.family, {k: v for k, v in batch.items() if k != "loss_mask"})
    assert torch.equal(kwargs["attention_mask"], batch["input_values_mask"])
    assert torch.equal(kwargs["decoder_attention_mask"], batch["attention_mask"])
    lengths = batch["input_values_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 1  # clips of different lengths: a real padding mask
    # Moonshine's encoder output depends on padding (GroupNorm over time): the training forward encodes each
    # clip alone, so a clip's taps in the padded batch are its taps alone, as batch-1 decoding sees them
    frames = target.target_inputs(batch)["encoder_outputs"]
    assert frames.attention_mask.sum(-1).tolist() == [
        model.model.encoder._get_feat_extract_output_lengths(int(n)) for n in lengths
    ]
    taps = target.capture(batch, [1, 3]).taps
    for i, n_audio in enumerate(lengths.tolist()):
        n = int(batch["attention_mask"][i].sum())
        alone = {
            "input_ids": batch["input_ids"][i : i + 1, :n],
            "attention_mask": batch["attention_mask"][i : i + 1, :n],
            "input_values": batch["input_values"][i : i + 1, :n_audio],
            "input_values_mask": batch["input_values_mask"][i : i + 1, :n_audio],
        }
        torch.testing.assert_close(target.capture(alone, [1, 3]).taps[0], taps[i, :n], rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # 5 s on 2 busy cores
def test_loss_is_invariant_to_padding_side(moonshine, tmp_path):
    from utils import make_args

    from dflash_hf import DFlashTrainer
    from dflash_hf.training.training_args import DFlashDataArguments

    model, processor = moonshine
    manifest = tiny.synthesize_speech(tmp_path / "speech", 4, seed=3)
    losses = {}
    for side in ("left", "right"):
        trainer = DFlashTrainer(
            args=make_args(
                tmp_path / side,
                mask_token_id=_mask_id(processor),
                block_size=BLOCK,
                num_draft_layers=1,
                label_source="target_argmax",
                target_layer_ids=[1, 3],
                seed=0,
            ),
            target=model,
            processor=processor,
            train_dataset=[str(manifest)],
            data_args=DFlashDataArguments(max_tokens=100_000, num_buckets=1, padding_side=side),
        )
        batch = next(iter(trainer.get_train_dataloader()))
        assert batch["input_ids"].shape[0] >= 2 and len(set(batch["input_values_mask"].sum(-1).tolist())) > 1
        assert len(set(batch["attention_mask"].sum(-1).tolist())) > 1  # the decoder side is padded too
        losses[side] = float(trainer.compute_loss(trainer.model, dict(batch)).detach())
    assert np.isfinite(losses["left"]) and losses["left"] == pytest.approx(losses["right"], rel=1e-5)


@pytest.mark.compat
@pytest.mark.slow  # 40 s on 2 busy cores
def test_speculative_greedy_equals_moonshine_generate_and_custom_generate(moonshine):
    model, processor = moonshine
    target = FrozenTarget(model)
    draft = _draft(target, processor)
    for seed, seconds in ((0, 1.0), (1, 0.7)):
        values = torch.from_numpy(_audio(seed, seconds))[None]
        ref = model.generate(input_values=values, max_new_tokens=20, return_dict_in_generate=True).sequences
        out = speculative_generate(draft, model, 20, input_values=values)
        assert torch.equal(out.sequences, ref) and out.sequences.shape[1] > 5, seed
        assert all(1 <= a <= BLOCK for a in out.acceptance_lengths)
        plain = model.generate(input_values=values, max_new_tokens=20)
        assert torch.equal(
            model.generate(input_values=values, max_new_tokens=20, custom_generate=dflash_custom_generate(draft)), plain
        )
    with pytest.raises(ValueError, match="needs input_values"):
        speculative_generate(draft, model, 4, input_ids=torch.tensor([[1]]))


@pytest.mark.slow  # 10 s on 2 busy cores
def test_dflash_train_eval_and_generate_labels_on_a_moonshine_target(tmp_path):
    from dflash_hf.cli import eval as cli_eval
    from dflash_hf.cli import generate_labels
    from dflash_hf.cli import train as cli_train

    model, processor = build_moonshine(seed=2)
    target_dir = tmp_path / "target"
    model.save_pretrained(target_dir)
    processor.save_pretrained(target_dir)
    manifest = tiny.synthesize_speech(tmp_path / "speech", 4, seed=3)
    metrics = cli_train.run(
        [
            "--target_name_or_path",
            str(target_dir),
            "--train_data",
            str(manifest),
            "--mask_token_id",
            str(_mask_id(processor)),
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "2",
            "--block_size",
            str(BLOCK),
            "--num_draft_layers",
            "1",
            "--use_cpu",
            "true",
            "--report_to",
            "none",
            "--label_source",
            "target_argmax",
            "--disable_tqdm",
            "true",
            "--save_strategy",
            "no",
        ]
    )
    assert np.isfinite(metrics["train_loss"]) and metrics["skipped_samples"] == 0
    cfg = json.loads((tmp_path / "out" / "draft" / "config.json").read_text())
    assert cfg["num_target_layers"] == 4 and cfg["hidden_size"] == 32

    out = tmp_path / "eval.json"
    assert (
        cli_eval.main(
            [
                "--draft",
                str(tmp_path / "out" / "draft"),
                "--target",
                str(target_dir),
                "--data",
                str(manifest),
                "--num_samples",
                "2",
                "--max_new_tokens",
                "8",
                "--output_json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["prompts"] == 2 and res["outputs_identical"] and res["greedy_tokens"] > 0
    assert res["family"] == "moonshine"  # the family the export records

    labels = tmp_path / "labels.jsonl"
    assert (
        generate_labels.main(
            [
                "--model",
                str(target_dir),
                "--manifest",
                str(manifest),
                "--output",
                str(labels),
                "--batch_size",
                "4",
                "--max_new_tokens",
                "30",
            ]
        )
        == 0
    )
    got = [json.loads(line) for line in labels.read_text().splitlines()]
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert len(got) == len(rows)
    import soundfile as sf  # each label is the target's own greedy transcript of that utterance, unbatched

    for row, line in zip(rows, got):
        audio, _ = sf.read(manifest.parent / row["audio_filepath"], dtype="float32")
        ids = model.generate(input_values=torch.from_numpy(audio)[None], max_new_tokens=30)
        assert line["text"] == processor.tokenizer.decode(ids[0], skip_special_tokens=True).strip()


def test_prompt_text_and_a_foreign_tokenizer_are_refused(moonshine, tmp_path):
    from dflash_hf.data.bad_samples import BadSampleError

    model, processor = moonshine
    manifest = tiny.synthesize_speech(tmp_path / "speech", 2, seed=0)
    family = FrozenTarget(model).family
    with pytest.raises(ValueError, match="takes no prompt text"):
        next(
            iter(
                build_train_dataloader(
                    manifest,
                    processor,
                    model.config,
                    family=family,
                    max_tokens=100_000,
                    conversation=ConversationConfig(prompt="Transcribe."),
                )
            )
        )
    other = tiny.build_tokenizer()
    other.bos_token = "<|audio_start|>"
    foreign = Wav2Vec2Processor(feature_extractor=processor.feature_extractor, tokenizer=other)
    with pytest.raises(BadSampleError, match="decoder_start_token_id"):
        next(iter(build_train_dataloader(manifest, foreign, model.config, family=family, max_tokens=100_000)))


def test_whitespace_around_a_transcript_and_too_short_clips_are_bad_samples(moonshine, tmp_path):
    from dflash_hf.data.bad_samples import BadSampleError

    model, processor = moonshine
    family = FrozenTarget(model).family
    manifest = tiny.synthesize_speech(tmp_path / "speech", 2, seed=0)
    rows = [json.loads(x) for x in manifest.read_text().splitlines()]
    for field, edit in (("text", {"text": rows[0]["text"] + " "}), ("duration", {"duration": 0.05})):
        bad = manifest.parent / f"{field}.json"  # relative audio paths: the same folder
        bad.write_text(json.dumps({**rows[0], **edit}) + "\n" + json.dumps(rows[1]) + "\n")
        with pytest.raises(BadSampleError, match=f"field '{field}'"):
            next(iter(build_train_dataloader(bad, processor, model.config, family=family, max_tokens=100_000)))
        loader = build_train_dataloader(
            bad, processor, model.config, family=family, max_tokens=100_000, skip_bad_samples=True
        )
        assert sum(b["input_ids"].shape[0] for b in loader) == 1  # the good row only, the bad one counted


def test_the_encoder_context_opt_in_is_refused_for_moonshine(moonshine, tmp_path):
    from utils import make_args

    from dflash_hf import DFlashTrainer

    model, processor = moonshine
    manifest = tiny.synthesize_speech(tmp_path / "speech", 2, seed=0)
    with pytest.raises(ValueError, match="draft_encoder_context"):
        DFlashTrainer(
            args=make_args(tmp_path, mask_token_id=_mask_id(processor), block_size=BLOCK, draft_encoder_context=True),
            target=model,
            processor=processor,
            train_dataset=[str(manifest)],
        )


def test_the_transcript_keeps_its_first_word_start_with_a_sentencepiece_tokenizer():
    """Moonshine's tokenizer is SentencePiece-style: "▁" marks a word start only at the start of a piece of text, so
    "<s>hello world</s>" tokenized in one string loses the "▁" of "hello" (not the ids the model decodes). The
    stream's transcript is tokenized on its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from dflash_hf.targets.families.moonshine import _stream_ids

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁hello": 3, "▁world": 4, "hello": 5}
    spm = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    spm.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=spm, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert tok("<s>hello world</s>", add_special_tokens=False)["input_ids"] == [1, 5, 4, 2]  # the pitfall
    assert _stream_ids(tok, "<s>hello world</s>") == [1, 3, 4, 2] and _stream_ids(tok, "<s>") == [1]
    assert tok.decode([3, 4]) == "hello world"
    assert FAMILIES["moonshine"].stream_ids is _stream_ids  # the validator's token counts use it too


def test_token_counts_are_the_batch_lengths(moonshine, tmp_path):
    """The validator's decoder token count of a sample (budgets, the max-positions check) is its row's length."""
    from dflash_hf.data.bad_samples import BadSamples
    from dflash_hf.data.conversation import ConversationRenderer
    from dflash_hf.data.sample_checks import SampleValidator

    model, processor = moonshine
    family = FrozenTarget(model).family
    manifest = tiny.synthesize_speech(tmp_path / "speech", 3, seed=5)
    renderer = ConversationRenderer(processor, family, ConversationConfig())
    validator = SampleValidator(renderer, family, model.config, max_tokens=None, bad=BadSamples())
    counts = sorted(validator.count_tokens(c) for c in open_source(manifest))
    loader = build_train_dataloader(
        manifest,
        processor,
        model.config,
        family=family,
        max_tokens=100_000,
        num_buckets=1,
        shuffle=False,
        max_batch_size=1,
    )
    assert counts == sorted(int(b["attention_mask"].sum()) for b in loader) and len(counts) == 3
