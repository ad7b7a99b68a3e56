"""The demo's assets (`dflash-demo`): a tiny Qwen3-ASR-style target taught to transcribe synthetic speech, saved with
its processor, and the speech's NeMo manifests; nothing is downloaded.

- :func:`build_demo_assets`: build the target, synthesize the train and dev speech, teach, save (:class:`DemoAssets`).
- :func:`teach_target`: teach a tiny target to transcribe a manifest (a plain causal-LM loss on the response).
- :func:`replayed_epochs`: a loader's first epoch, then its batches again in a new order each epoch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash_hf.testing import tiny

# Channels of the tiny target's audio convolutions: more than the tiny builder's default (8), so that the random
# encoder's frames of different words differ enough for the target to learn to tell the words apart in the demo's
# budget.
TARGET_AUDIO_CONV_CHANNELS = 32
# Silence before each tone word (s): about one encoder frame (80 ms) between words, so that words are not dropped,
# repeated or swapped where they run together.
SPEECH_WORD_GAP = 0.1


@dataclass(frozen=True)
class DemoAssets:
    """What `build_demo_assets` wrote: the target (model + processor) directory, the train and dev manifests, and the
    target's reserved mask token id."""

    target_dir: Path
    train_manifest: Path
    dev_manifest: Path
    mask_token_id: int


def teach_target(
    model: torch.nn.Module,
    processor,
    manifest: Path,
    steps: int,
    prompt: str | None,
    lr: float = 3e-3,
    max_tokens: int = 1500,
) -> float:
    """Teach the random tiny target to transcribe the synthetic speech (plain causal-LM loss on the response; AdamW,
    linear warm-up over the first tenth of the steps, then cosine decay), so it behaves like a small ASR model.
    Returns the mean loss of the last ten steps."""
    from transformers import get_cosine_schedule_with_warmup

    from dflash_hf.data import ConversationConfig, build_train_dataloader

    loader = build_train_dataloader(
        str(manifest), processor, model.config, max_tokens=max_tokens, conversation=ConversationConfig(prompt=prompt)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = get_cosine_schedule_with_warmup(opt, max(1, steps // 10), steps)
    model.train()
    losses: list[float] = []
    with tqdm(total=steps, desc="teaching the tiny target") as bar:
        for batch in itertools.islice(replayed_epochs(loader), steps):
            labels = torch.where(batch["loss_mask"], batch["input_ids"], -100)
            loss = model(**{k: v for k, v in batch.items() if k != "loss_mask"}, labels=labels).loss
            loss.backward()
            opt.step()
            schedule.step()
            opt.zero_grad()
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return sum(losses[-10:]) / max(1, len(losses[-10:]))


def replayed_epochs(loader: Iterable[dict]) -> Iterator[dict]:
    """The loader's first epoch, then its batches again in a new order each epoch, endlessly: reading and
    featurizing the audio again took a third of each teaching step."""
    first: list[dict] = []
    for batch in loader:
        first.append(batch)
        yield batch
    if not first:
        raise ValueError("the demo's training manifest gave no batch to teach the target with")
    order = torch.Generator().manual_seed(0)
    while True:
        for i in torch.randperm(len(first), generator=order).tolist():
            yield first[i]


def build_demo_assets(
    root: Path,
    *,
    num_train_utterances: int,
    num_dev_utterances: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    teach_steps: int,
    teach_learning_rate: float,
    teach_max_tokens: int,
    prompt: str | None,
) -> DemoAssets:
    """Build the tiny target (seed 0; `num_heads // 2` key/value heads, at least 1), synthesize the train (seed 0) and
    dev (seed 1) speech under `root`, teach the target `teach_steps` steps on the train speech (0: leave it random;
    `prompt`: the instruction it is taught with), and save it with its processor in `root / "target"`."""
    tokenizer = tiny.build_tokenizer()
    model, processor = tiny.build_qwen3_asr_target(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=max(1, num_heads // 2),
        audio_conv_channels=TARGET_AUDIO_CONV_CHANNELS,
        seed=0,
    )
    train = tiny.synthesize_speech(root / "speech_train", num_train_utterances, seed=0, word_gap=SPEECH_WORD_GAP)
    dev = tiny.synthesize_speech(root / "speech_dev", num_dev_utterances, seed=1, word_gap=SPEECH_WORD_GAP)
    if teach_steps:
        torch.manual_seed(0)
        teach_target(model, processor, train, teach_steps, prompt, lr=teach_learning_rate, max_tokens=teach_max_tokens)
    target_dir = root / "target"
    model.save_pretrained(target_dir)
    processor.save_pretrained(target_dir)
    return DemoAssets(target_dir, train, dev, tokenizer.convert_tokens_to_ids(tiny.MASK_TOKEN))


__all__ = ["DemoAssets", "build_demo_assets", "replayed_epochs", "teach_target"]
