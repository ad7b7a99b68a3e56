"""Reading a CTranslate2 ``model.bin`` (binary version 6) and mapping its Whisper variables to transformers names."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def read_ct2_model(path: Path) -> tuple[str, int, dict[str, np.ndarray]]:
    """Parse a CTranslate2 ``model.bin`` (binary version 6): ``(spec name, spec revision, variables)``.

    Layout (little endian): u32 version, string spec name, u32 revision, u32 count, then per variable: string
    name, u8 rank, u32 dims[rank], u8 dtype id, u32 byte count, raw bytes; then u32 alias count and
    (alias, target) string pairs. A string is u16 length (with the trailing NUL) + bytes. Aliases are
    returned as extra names pointing at the same array.
    """
    data = memoryview(path.read_bytes())
    pos = 0

    def unpack(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal pos
        (n,) = unpack("H")
        raw = bytes(data[pos : pos + n])
        pos += n
        return raw.rstrip(b"\0").decode("utf-8")

    (version,) = unpack("I")
    if version != 6:
        raise ValueError(f"{path}: CTranslate2 binary version {version}; this reader handles version 6")
    spec, (revision,), (count,) = string(), unpack("I"), unpack("I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(count):
        name = string()
        (rank,) = unpack("B")
        shape = unpack(f"{rank}I") if rank else ()
        dtype_id, nbytes = unpack("B")[0], unpack("I")[0]
        if dtype_id not in CT2_DTYPES:
            raise ValueError(f"{path}: variable {name} has dtype id {dtype_id} (bfloat16 and others unsupported)")
        array = np.frombuffer(data[pos : pos + nbytes], dtype=CT2_DTYPES[dtype_id]).reshape(shape)
        pos += nbytes
        variables[name] = array
    (aliases,) = unpack("I")
    for _ in range(aliases):
        alias, target = string(), string()
        variables[alias] = variables[target]
    if pos != len(data):
        raise ValueError(f"{path}: {len(data) - pos} trailing bytes after the variables; not a version 6 model.bin")
    return spec, revision, variables


def ct2_whisper_to_hf(variables: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """Map CTranslate2 ``WhisperSpec`` variables to ``WhisperForConditionalGeneration`` names.

    CT2 fuses self-attention q/k/v into ``self_attention/linear_0`` and cross-attention k/v into
    ``attention/linear_1`` (Whisper's k projection has no bias: CT2 stores zeros there, checked), and names
    layer norms ``gamma``/``beta``. Returns (shape facts for the config, state dict)."""
    v = variables
    for key, want in (("decoder/pre_norm", 1), ("decoder/scale_embeddings", 0), ("decoder/activation", 3)):
        if key in v and int(v[key]) != want:
            raise ValueError(f"CT2 {key} = {int(v[key])}, expected {want} for Whisper")
    d_model = v["encoder/conv2/weight"].shape[0]
    n_enc, n_dec = (
        len({m.group(1) for k in v if (m := re.match(rf"{side}/layer_(\d+)/", k))}) for side in ("encoder", "decoder")
    )
    sd: dict[str, np.ndarray] = {}

    def norm(dst: str, src: str):
        sd[f"{dst}.weight"], sd[f"{dst}.bias"] = v[f"{src}/gamma"], v[f"{src}/beta"]

    def linear(dst: str, src: str, bias: bool = True):
        sd[f"{dst}.weight"] = v[f"{src}/weight"]
        if bias:
            sd[f"{dst}.bias"] = v[f"{src}/bias"]

    def split(src: str, dsts: list[str | None]):
        """Split a fused projection along its output rows; a ``None`` part is a k projection without bias."""
        weights = np.split(v[f"{src}/weight"], len(dsts), axis=0)
        biases = np.split(v[f"{src}/bias"], len(dsts), axis=0)
        for dst, w, b in zip(dsts, weights, biases):
            name = dst.rstrip("!")
            sd[f"{name}.weight"] = w
            if dst.endswith("!"):
                if np.any(b != 0):
                    raise ValueError(f"CT2 {src}: the k projection bias is not zero; cannot drop it")
            else:
                sd[f"{name}.bias"] = b

    def ffn(dst: str, src: str):
        norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
        linear(f"{dst}.fc1", f"{src}/ffn/linear_0")
        linear(f"{dst}.fc2", f"{src}/ffn/linear_1")

    def self_attention(dst: str, src: str) -> None:  # fused q/k/v (k without bias), output projection, its norm
        norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
        split(f"{src}/self_attention/linear_0", [f"{dst}.self_attn.{p}" for p in ("q_proj", "k_proj!", "v_proj")])
        linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")

    enc, dec = "model.encoder", "model.decoder"
    for i in (1, 2):
        linear(f"{enc}.conv{i}", f"encoder/conv{i}")
    sd[f"{enc}.embed_positions.weight"] = v["encoder/position_encodings/encodings"]
    norm(f"{enc}.layer_norm", "encoder/layer_norm")
    for i in range(n_enc):
        dst, src = f"{enc}.layers.{i}", f"encoder/layer_{i}"
        self_attention(dst, src)
        ffn(dst, src)
    sd[f"{dec}.embed_tokens.weight"] = v["decoder/embeddings/weight"]
    sd[f"{dec}.embed_positions.weight"] = v["decoder/position_encodings/encodings"]
    norm(f"{dec}.layer_norm", "decoder/layer_norm")
    for i in range(n_dec):
        dst, src = f"{dec}.layers.{i}", f"decoder/layer_{i}"
        self_attention(dst, src)
        norm(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm")
        linear(f"{dst}.encoder_attn.q_proj", f"{src}/attention/linear_0")
        split(f"{src}/attention/linear_1", [f"{dst}.encoder_attn.k_proj!", f"{dst}.encoder_attn.v_proj"])
        linear(f"{dst}.encoder_attn.out_proj", f"{src}/attention/linear_2")
        ffn(dst, src)
    projection = v.get("decoder/projection/weight")
    if projection is not None and projection is not v["decoder/embeddings/weight"]:
        raise ValueError("CT2 decoder/projection/weight is not an alias of the embeddings; untied heads unsupported")
    facts = dict(
        d_model=d_model,
        encoder_layers=n_enc,
        decoder_layers=n_dec,
        encoder_attention_heads=int(v["encoder/num_heads"]),
        decoder_attention_heads=int(v["decoder/num_heads"]),
        encoder_ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        num_mel_bins=v["encoder/conv1/weight"].shape[1],
        vocab_size=v["decoder/embeddings/weight"].shape[0],
        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
    )
    return facts, sd
