"""Cut -> conversation -> rendered text and supervision pattern (NeMo ``lhotse_as_conversation``).

A cut becomes: optional system turn (the cut's ``system_prompt`` custom field, else the configured one);
a user turn with the cut's ``context`` custom field (else the configured default prompt; omitted when empty)
followed by the audio; an assistant turn with ``cut.supervisions[0].text``. The target's own chat template
renders it (the processor's, or the tokenizer's for families whose ``render_with == "tokenizer"``);
encoder-decoder families (Whisper) render the decoder's own prompt with ``family.render_decoder`` instead.

Supervision: the assistant response tokens and the assistant turn's closing end-of-turn token. It is
computed on the rendered *suffix* after the generation prompt (the part of the text that comes after all
audio), so it does not depend on audio expansion and is reusable by packed (THD) collators.

Generated labels (``generated.py``): a cut marked ``truncated`` is rendered up to the end of its response (no end of
turn, nothing of it supervised); a cut with ``label_ids`` has those ids in place of its response's tokens in
``RenderedSample.suffix_ids`` (the text's own tokens kept in ``text_suffix_ids`` for the collator to replace).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial

from dflash_hf.data.generated import generated_fields, splice_response
from dflash_hf.targets.families.base import TargetFamily, get_tokenizer

MAX_REMEMBERED_PROMPTS = 4096  # distinct user turns whose rendered prompt is kept (cleared when full)
RENDERED_TEXT_KEY = "dflash_rendered_text"  # `cut.custom`: (`conversation_key`, the validator's rendered text)


@dataclass
class ConversationConfig:
    """How a cut becomes a conversation. ``prompt`` is the default user text (a cut's ``context`` field
    overrides it); ``system_prompt`` likewise (a cut's ``system_prompt`` field overrides it)."""

    system_prompt: str | None = None
    prompt: str | None = None
    context_key: str = "context"
    system_prompt_key: str = "system_prompt"


@dataclass
class RenderedSample:
    """One rendered conversation. ``text`` has the audio placeholder(s) unexpanded, as the chat template
    writes them; ``suffix_ids`` are the tokens after the generation prompt and ``suffix_supervised`` says which
    of them are labels (response tokens + closing end-of-turn token). ``text_suffix_ids``: where the cut's
    ``label_ids`` replaced the response's tokens, the suffix's tokens as the text tokenizes (the collator finds them at
    the end of the row and puts ``suffix_ids`` in their place); None otherwise."""

    cut_id: str
    text: str
    suffix_ids: list[int]
    suffix_supervised: list[bool]
    text_suffix_ids: list[int] | None = None


def _custom(cut, key):
    return (cut.custom or {}).get(key)


def cut_to_messages(cut, family: TargetFamily, config: ConversationConfig | None = None) -> list[dict]:
    """The conversation of one cut (see the module docstring)."""
    config = config or ConversationConfig()
    response = cut.supervisions[0].text
    system = _custom(cut, config.system_prompt_key) or config.system_prompt
    context = _custom(cut, config.context_key)
    context = config.prompt if context is None else context
    messages = []
    if not family.has_audio:
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": context or ""})
        messages.append({"role": "assistant", "content": response})
        return messages
    if system:
        messages.append({"role": "system", "content": [{"type": "text", "text": system}]})
    user = [{"type": "text", "text": context}] if context else []
    audio = {"type": "audio"}
    if family.is_encoder_decoder and cut.supervisions[0].language:
        audio["language"] = cut.supervisions[0].language  # the decoder prompt names it (Whisper)
    user.append(audio)
    messages.append({"role": "user", "content": user})
    messages.append({"role": "assistant", "content": [{"type": "text", "text": response}]})
    return messages


def conversation_key(cut, family: TargetFamily, config: ConversationConfig | None = None) -> tuple[list[dict], bytes]:
    """The cut's conversation (`cut_to_messages`) and 16 bytes that tell samples apart by what decides their rendered
    text and token counts: the conversation, for audio the duration, and the generated-label fields (`label_ids`,
    `truncated`). The validator remembers counts and texts by it, and the collation checks a handed-on text with it."""
    messages = cut_to_messages(cut, family, config)
    duration = cut.duration if family.has_audio else None
    facts = (messages, duration, *generated_fields(cut))
    return messages, hashlib.blake2b(repr(facts).encode(), digest_size=16).digest()


class ConversationRenderer:
    """Renders cuts with the target's chat template and finds the supervised suffix tokens."""

    def __init__(self, processor, family: TargetFamily, config: ConversationConfig | None = None):
        self.family = family
        self.config = config or ConversationConfig()
        self.tokenizer = get_tokenizer(processor)
        self._special_ids = set(self.tokenizer.all_special_ids)
        self._prompts: dict[str, str] = {}  # rendered generation prompts by their turns (`_prompt`)
        if family.is_encoder_decoder:  # the family renders the decoder's own prompt
            self._apply = partial(family.render_decoder, self.tokenizer)
            return
        owner = processor if family.render_with == "processor" else self.tokenizer
        if not getattr(owner, "chat_template", None):
            raise ValueError(
                f"the target's {'processor' if owner is processor else 'tokenizer'} has no chat template; "
                "set one (processor.chat_template / tokenizer.chat_template) before training"
            )
        self._apply = owner.apply_chat_template

    def render_text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._apply(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def render_conversation(self, messages: list[dict], truncated: bool = False) -> str:
        """The whole conversation's text; `truncated` (an output cut by a token limit): up to the end of the
        response, without the end of the turn the template writes after it."""
        full = self.render_text(messages)
        if not truncated:
            return full
        prompt = self._prompt(messages[:-1], full)
        response = messages[-1]["content"]
        response = response if isinstance(response, str) else "".join(i["text"] for i in response)
        start = full.find(response, len(prompt)) if full.startswith(prompt) else -1
        if start < 0:
            return full  # `_locate` names the problem
        return full[: start + len(response)]

    def _prompt(self, turns: list[dict], full: str) -> str:
        """The rendered generation prompt of `turns` (all but the assistant's), remembered by the turns: a speech
        data set's user turns are mostly one instruction and the audio. A remembered prompt that no longer prefixes
        `full` (a template that renders the date) is rendered again."""
        key = repr(turns)
        prompt = self._prompts.get(key)
        if prompt is None or not full.startswith(prompt):
            prompt = self.render_text(turns, add_generation_prompt=True)
            if len(self._prompts) >= MAX_REMEMBERED_PROMPTS:
                self._prompts.clear()
            self._prompts[key] = prompt
        return prompt

    def render(self, cut) -> RenderedSample:
        return self.render_many([cut])[0]

    def render_many(self, cuts) -> list[RenderedSample]:
        """Each cut rendered, its assistant turn located and its supervised suffix tokens marked; the suffixes
        are tokenized in one call (a cut's own tokens do not depend on the others)."""
        located = [self._locate(cut) for cut in cuts]
        enc = (
            self.tokenizer(
                [suffix for _, _, suffix, _ in located], add_special_tokens=False, return_offsets_mapping=True
            )
            if located
            else {"input_ids": [], "offset_mapping": []}
        )
        return [
            self._supervise(cut, full, suffix, span, ids, offsets)
            for (cut, full, suffix, span), ids, offsets in zip(located, enc["input_ids"], enc["offset_mapping"])
        ]

    def _locate(self, cut) -> tuple:
        """`(cut, full text, assistant suffix, (start, end) of the response in the suffix)`."""
        messages, key = conversation_key(cut, self.family, self.config)
        response = cut.supervisions[0].text
        truncated = generated_fields(cut)[1]
        saved = _custom(cut, RENDERED_TEXT_KEY)  # (key, text) the validator rendered to count it
        saved = saved[1] if isinstance(saved, tuple) and saved[0] == key else None
        full = saved if saved is not None else self.render_conversation(messages, truncated)
        prompt = self._prompt(messages[:-1], full)
        if full is saved and not full.startswith(prompt):  # rendered at another moment (a template with the date)
            full = self.render_conversation(messages, truncated)
            prompt = self._prompt(messages[:-1], full)
        if not full.startswith(prompt):
            raise ValueError(
                f"cut {cut.id!r}: the chat template's generation prompt {prompt[-40:]!r} is not a prefix of the "
                "rendered conversation, so the assistant turn cannot be located; use a template whose "
                "add_generation_prompt output prefixes the full conversation"
            )
        suffix = full[len(prompt) :]
        start = suffix.find(response)
        if start < 0:
            raise ValueError(
                f"cut {cut.id!r}: the chat template changed the response text; the rendered "
                f"assistant turn is {suffix!r}"
            )
        return cut, full, suffix, (start, start + len(response))

    def _supervise(self, cut, full: str, suffix: str, span: tuple[int, int], ids: list[int], offsets) -> RenderedSample:
        start, end = span
        supervised = [s < end and e > start and e > s for s, e in offsets]
        last = max((i for i, flag in enumerate(supervised) if flag), default=-1)
        if last < 0:
            raise ValueError(f"cut {cut.id!r}: no token covers the response {cut.supervisions[0].text!r}")
        text_ids, label_ids = None, generated_fields(cut)[0]
        if label_ids is not None:  # the target's own tokens in place of the text's
            spliced, supervised = splice_response(
                cut.id, suffix, ids, offsets, supervised, cut.supervisions[0].text, label_ids
            )
            text_ids = ids if spliced != ids else None
            ids, last = spliced, max(i for i, flag in enumerate(supervised) if flag)
        if last + 1 < len(ids) and ids[last + 1] in self._special_ids:
            supervised[last + 1] = True  # the assistant turn's closing end-of-turn token
        return RenderedSample(cut.id, full, ids, supervised, text_ids)
