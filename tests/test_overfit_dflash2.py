"""DFlash2 overfit gate: memorize one target-generated sequence, then accept (almost) whole blocks."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from utils import text_batch, tiny_text_target

from dflash_hf import DFlash2DraftModel, DFlashTrainer, DFlashTrainingArguments, speculative_generate, tiny


class Repeat(Dataset):
    def __init__(self, row, times: int):
        self.row, self.times = row, times

    def __len__(self):
        return self.times

    def __getitem__(self, i):
        return self.row


def test_dflash2_overfits_one_sequence_then_accepts_full_blocks(tmp_path):
    """Guards the DFlash2 path end to end: conv block boundaries, teacher-forced selector predecessors and
    the selector walk at inference must all agree, or acceptance collapses even on memorized data."""
    model, tok = tiny_text_target()
    tiny.sharpen(model)
    prompt = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(0))
    full = model.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=48, do_sample=False, eos_token_id=None
    )
    response = full[0, 12:].tolist()
    assert len(set(response)) > 10  # a varied sequence, not one repeated token
    block = 8
    args = DFlashTrainingArguments(
        output_dir=str(tmp_path / "out"), variant="dflash2", mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN),
        block_size=block, num_draft_layers=2, conv_group_size=16, selector_rank=32, selector_top_k=16,
        per_device_train_batch_size=1, max_steps=150, learning_rate=3e-3, label_source="ground_truth",
        num_anchors=64, save_strategy="no", use_cpu=True, report_to="none", disable_tqdm=True,
        attention_backend="sdpa", seed=0, logging_steps=50,
    )
    torch.manual_seed(0)
    trainer = DFlashTrainer(
        args=args, target=model, train_dataset=Repeat((prompt[0].tolist(), response), 150),
        data_collator=lambda items: text_batch(items, tok.pad_token_id),
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][-1]  # the last 50 steps
    assert logged["selector_accuracy"] > 0.9 and logged["candidate_recall"] > 0.9, logged
    draft = trainer.model.eval()
    assert isinstance(draft, DFlash2DraftModel)
    assert draft.candidate_selector.successor_codebook.abs().sum() > 0  # the selector was trained
    model.generation_config.eos_token_id = None
    out = speculative_generate(draft, model, 48, input_ids=prompt, attention_mask=torch.ones_like(prompt))
    assert torch.equal(out.sequences, full)
    assert out.tau >= 0.9 * block, out.acceptance_lengths
