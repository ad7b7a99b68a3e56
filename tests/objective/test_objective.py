"""The objective without a Trainer, its loss and label registries: D-PACE weights, soft target-distribution labels
(equal to the CE with one-hot labels, chunked), registry errors, and the package's shape (no import circle)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from utils import (
    REPO_ROOT,
    LargestAllocation,
    make_trainer,
    mixed_padding_batch,
    random_rows,
    row_inputs,
    text_batch,
    tiny_text_target,
)

from dflash_hf import DFlashTrainingArguments
from dflash_hf.objective.blocks import slot_decay
from dflash_hf.objective.labels import make_label_source
from dflash_hf.objective.labels.target_distribution import topk_distribution
from dflash_hf.objective.losses import make_loss
from dflash_hf.objective.losses.common import slot_cross_entropy
from dflash_hf.objective.losses.dpace import dpace_weights
from dflash_hf.settings import ObjectiveSettings
from dflash_hf.targets.frozen import FrozenTarget

PACKAGE = REPO_ROOT / "dflash_hf"


def _trainer(tmp_path, text_target_4x64, **kw):
    model, tok = text_target_4x64
    kw = (
        dict(
            block_size=4, num_anchors=5, anchor_pad_multiple=1, label_source="target_argmax", use_fused_linear_ce=False
        )
        | kw
    )
    return make_trainer(tmp_path, model, tok, random_rows(3, 250, seed=7), **kw)


def _run(trainer, batch):
    """(BlockLoss, final-normed draft hidden [b, N, B, H]) of `batch` through the objective, without the Trainer."""
    seen = {}
    hook = trainer.model.norm.register_forward_hook(lambda _m, _a, out: seen.__setitem__("h", out))
    try:
        plan = trainer.objective.plan(trainer.target, batch, seed=0)
        out = trainer.objective.loss(trainer.model, trainer.target, batch, plan)
    finally:
        hook.remove()
    b, n, bs = out.blocks.ids.shape
    return out, seen["h"].view(b, n, bs, -1)


def _slot_logits(hidden, blocks, trainer):
    """`{(row, block, k): float32 logits}` of every valid slot (k = 0..B-2 is slot k+1), by brute force."""
    weight = trainer.target.lm_head.weight
    return {(r, n, k): (hidden[r, n, k + 1] @ weight.T).float() for r, n, k in blocks.valid.nonzero().tolist()}


# ---------------------------------------------------------------------------------------------- D-PACE
def test_dpace_weights_closed_form():
    """`w_j = Σ_{m>=j} Π_{i<=m} q~_i`; an invalid slot (q~ = 0) ends the chain and gets no weight."""
    q = torch.tensor([[0.5, 0.5, 1.0], [0.5, 0.5, 0.0], [0.9, 0.0, 0.7]])
    torch.testing.assert_close(dpace_weights(q), torch.tensor([[1.0, 0.5, 0.25], [0.75, 0.25, 0.0], [0.9, 0, 0]]))
    smoothed = torch.rand(6, 7, generator=torch.Generator().manual_seed(0)) * 0.5 + 0.5
    w = dpace_weights(smoothed)
    assert bool((w[:, 1:] <= w[:, :-1]).all())  # non-increasing along the block


def test_dpace_loss_matches_reference(tmp_path, text_target_4x64):
    """Through the objective: loss_sum = Σ w·CE with D-PACE weights from the detached draft confidence, the
    denominator (planned and in the sums) = number of blocks; the default CE keeps the decay."""
    model, tok = text_target_4x64
    batch = text_batch(random_rows(3, 250, seed=8), tok.pad_token_id, "left")
    trainer = _trainer(tmp_path, text_target_4x64, loss_type="dpace", dpace_alpha=0.3)
    out, hidden = _run(trainer, batch)
    blocks = out.blocks
    logits = _slot_logits(hidden, blocks, trainer)
    ce = {key: F.cross_entropy(z[None], blocks.labels[key][None]) for key, z in logits.items()}
    ref = 0.0
    for r, n in blocks.anchor_valid.nonzero().tolist():
        ks = [k for k in range(3) if (r, n, k) in ce]
        q = {k: 0.7 * math.exp(-ce[(r, n, k)].item()) + 0.3 for k in ks}
        for j in ks:
            w = sum(math.prod(q.get(i, 0.0) for i in range(m + 1)) for m in range(j, 3))
            ref += w * ce[(r, n, j)].item()
    n_blocks = int(blocks.anchor_valid.sum())
    assert n_blocks > 3 and out.weight_sum.item() == n_blocks and not out.denominator_after_forward
    assert trainer.objective.plan(trainer.target, batch, seed=0).denominator.item() == n_blocks
    assert out.loss_sum.item() == pytest.approx(ref, rel=1e-5)
    out.loss_sum.backward()
    assert all(p.grad is not None for p in trainer.model.parameters() if p.requires_grad)

    ce_trainer = _trainer(tmp_path, text_target_4x64)
    base, _ = _run(ce_trainer, batch)
    torch.testing.assert_close(base.weight_sum, (slot_decay(4, ce_trainer.objective.gamma) * blocks.valid).sum())


# ---------------------------------------------------------------------------------------------- soft labels
def test_soft_cross_entropy_with_one_hot_is_the_hard_ce():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 3, 10, 7, 7])
    ids = torch.stack([labels, (labels + 1) % 11, (labels + 2) % 11], dim=-1)
    one_hot = torch.tensor([[1.0, 0.0, 0.0]]).expand(5, 3)
    torch.testing.assert_close(
        slot_cross_entropy(logits, labels, ids, one_hot), F.cross_entropy(logits, labels, reduction="none")
    )


def test_target_distribution_top1_equals_target_argmax(tmp_path, text_target_4x64):
    """label_top_k=1 is the target_argmax CE: same labels, same loss and gradients."""
    _, tok = text_target_4x64
    batch = text_batch(random_rows(3, 250, seed=9), tok.pad_token_id, "right")
    runs = {}
    for source in ("target_argmax", "target_distribution"):
        trainer = _trainer(tmp_path, text_target_4x64, label_source=source, label_top_k=1)
        out, _ = _run(trainer, batch)
        out.loss_sum.backward()
        runs[source] = (out, {k: p.grad.clone() for k, p in trainer.model.named_parameters()})
    (hard, g_hard), (soft, g_soft) = runs["target_argmax"], runs["target_distribution"]
    assert torch.equal(hard.blocks.labels, soft.blocks.labels) and torch.equal(hard.correct, soft.correct)
    torch.testing.assert_close(soft.loss_sum, hard.loss_sum)
    for k in g_hard:
        torch.testing.assert_close(g_soft[k], g_hard[k], msg=k)


def test_target_distribution_loss_matches_reference(tmp_path, text_target_4x64):
    """Slot k of the block at a learns the target's renormalized top-k distribution at a+k (from its final-normed
    state at a+k-1): loss_sum = Σ w · (-Σ_v p(v) log softmax(draft logits)(v)), by brute force."""
    model, tok = text_target_4x64
    batch = text_batch(random_rows(3, 250, seed=10), tok.pad_token_id, "left")
    trainer = _trainer(tmp_path, text_target_4x64, label_source="target_distribution", label_top_k=3)
    out, hidden = _run(trainer, batch)
    final, _, _, _, _ = row_inputs(trainer.target, batch)
    blocks, decay = out.blocks, slot_decay(4, trainer.objective.gamma)
    ref = 0.0
    for (r, n, k), z in _slot_logits(hidden, blocks, trainer).items():
        p_logits, ids = trainer.target.lm_head(final[r, int(blocks.anchors[r, n]) + k]).topk(3)
        assert blocks.labels[r, n, k] == ids[0]
        ref += decay[k] * -(torch.softmax(p_logits.float(), -1) * torch.log_softmax(z, -1)[ids]).sum()
    torch.testing.assert_close(out.loss_sum, ref)


@pytest.mark.parametrize("chunk", [1, 7])
def test_target_distribution_is_chunked(text_target_4x64, chunk):
    """No `[S, vocab]` tensor: at most `chunk` positions are projected to the vocabulary at a time."""
    model, tok = text_target_4x64
    ft = FrozenTarget(model)
    final, ids, loss_mask, doc_ids, _ = row_inputs(ft, mixed_padding_batch(tok, "left"))
    with LargestAllocation() as probe:
        soft = topk_distribution(ft.lm_head, final, ids, loss_mask, doc_ids, top_k=4, chunk_size=chunk)
    assert 0 < probe.largest <= max(chunk * ft.vocab_size, ids.numel() * 4)
    assert probe.largest < ids.shape[1] * ft.vocab_size
    torch.testing.assert_close(soft.probs.sum(-1), torch.ones(ids.shape))


@pytest.mark.parametrize(
    "variant,loss_type,label_source",
    [("dflash", "dpace", "target_argmax"), ("dflash2", "dpace", "target_distribution")],
)
@pytest.mark.slow  # 5 s on 2 busy cores
def test_trainer_trains_with_each_loss_and_label_source(tmp_path, text_target_4x64, variant, loss_type, label_source):
    """Trainer.train with gradient accumulation: finite logged losses, the weights move; DFlash2 adds the selector."""
    trainer = _trainer(
        tmp_path,
        text_target_4x64,
        variant=variant,
        loss_type=loss_type,
        label_source=label_source,
        label_top_k=3,
        selector_top_k=4,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-2,
        use_fused_linear_ce=None,
    )
    before = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2 and all(math.isfinite(e["loss"]) for e in logs)
    assert ("selector_loss" in logs[0]) == (variant == "dflash2")
    for e in logs:  # host timings beside the loss: waiting for the loader is part of the step's wall time
        assert 0.0 <= e["data_wait_ms"] <= e["step_ms"] and e["plan_ms"] >= 0.0
    assert any(not torch.equal(before[k], p) for k, p in trainer.model.named_parameters())


@pytest.mark.slow  # 5 s on 2 busy cores
def test_objective_without_a_trainer_equals_compute_loss(tmp_path, text_target_4x64):
    """A standalone DFlashObjective (FrozenTarget, draft, arguments) gives the trainer's compute_loss exactly; in
    Trainer.train every micro-batch is planned once, in get_batch_samples, and that plan reaches compute_loss."""
    from dflash_hf.objective.dflash_objective import DFlashObjective

    model, tok = text_target_4x64
    trainer = _trainer(
        tmp_path, text_target_4x64, per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=1
    )
    batch = text_batch(random_rows(2, 250, seed=12), tok.pad_token_id, "left")
    objective = DFlashObjective.from_args(trainer.args, trainer.model.config)
    ft = FrozenTarget(model)
    plan = objective.plan(ft, batch, seed=3)
    loss, skipped = objective.normalize(
        objective.loss(trainer.model, ft, batch, plan), plan.denominator, training_step=True, accumulation=2
    )
    ref = trainer.compute_loss(trainer.model, dict(batch), plan=plan, num_items_in_batch=plan.denominator)
    assert torch.equal(loss, ref) and not bool(skipped)

    calls = []
    original = trainer.objective.plan
    trainer.objective.plan = lambda *a, **kw: calls.append(a[2] if len(a) > 2 else kw["seed"]) or original(*a, **kw)
    trainer.train()
    assert len(calls) == 2 and calls[0] != calls[1]  # one plan per micro-batch (distinct seeds), none in the step


# ---------------------------------------------------------------------------------------------- label agreement
def _own_rows(model, rows, corrupt_every: int):
    """Each row's response replaced by the target's own greedy continuation of its prompt, every `corrupt_every`-th
    token of it then changed: the data agrees with the target at some relabelled positions and not at others."""
    out = []
    for p, r in rows:
        with torch.no_grad():
            own = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=len(r),
                min_new_tokens=len(r),
                do_sample=False,
            )[0, len(p) :].tolist()
        out.append((p, [3 + (t + 1) % 240 if i % corrupt_every == 2 else t for i, t in enumerate(own)]))
    return out


@pytest.mark.parametrize("label_source", ["target_argmax", "target_distribution", "ground_truth"])
@pytest.mark.slow  # 9 s on 2 busy cores
def test_data_agreement_counts_the_relabelled_positions_where_the_target_writes_the_data(
    tmp_path, text_target_4x64, label_source
):
    """`target_agreement` = (label == data token) over the positions a target label source relabels, brute force
    from the target's full logits; ground_truth labels nothing, so training has no such metric, and its evaluation
    counts the target's greedy token against the data's at the same positions."""
    from dflash_hf.objective.blocks import label_positions
    from dflash_hf.objective.losses import MetricSums

    model, tok = text_target_4x64
    trainer = _trainer(tmp_path, text_target_4x64, label_source=label_source, label_top_k=3)
    rows = _own_rows(model, random_rows(3, 250, seed=5), corrupt_every=4)
    batch = text_batch(rows, tok.pad_token_id, "right")  # right padding: the plan's rows keep the batch's columns
    out, _ = _run(trainer, batch)
    if label_source == "ground_truth":
        assert out.data_agreement is None
        trainer.model.eval()
        out, _ = _run(trainer, batch)
    with torch.no_grad():
        greedy = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    plan = trainer.objective.plan(trainer.target, batch, seed=0)
    need = label_positions(plan.loss_mask, plan.doc_ids)
    agree = (greedy[:, :-1] == batch["input_ids"][:, 1:]) & need[:, 1:]
    agreeing, relabelled = (int(x) for x in out.data_agreement)
    assert relabelled == int(need.sum()) and agreeing == int(agree.sum())
    left, _ = _run(trainer, text_batch(rows, tok.pad_token_id, "left"))
    assert (left.data_agreement is None) == (label_source == "ground_truth" and trainer.model.training)
    assert [int(x) for x in left.data_agreement] == [agreeing, relabelled]  # padding side changes nothing
    assert 0.4 < agreeing / relabelled < 0.95  # the corrupted tokens and what follows them disagree
    sums = MetricSums()
    sums.add_block_loss(out)
    assert sums.reduce()["target_agreement"] == pytest.approx(agreeing / relabelled)


def test_low_label_agreement_is_warned_once_per_metric(monkeypatch):
    from dflash_hf.training import callbacks

    warned = []
    monkeypatch.setattr(callbacks.logger, "warning", lambda msg, *args: warned.append(msg % args))
    cb = callbacks.LabelAgreementCallback(threshold=0.9)
    state = type("S", (), {"global_step": 7, "is_world_process_zero": True})()
    cb.on_log(
        None, type("S", (), {"global_step": 7, "is_world_process_zero": False})(), None, logs={"target_agreement": 0.5}
    )  # another rank: silent
    assert not warned and not cb.warned
    for logs in (
        {"target_agreement": 0.95},
        {"target_agreement": 0.71, "loss": 2.0},
        {"target_agreement": 0.7},
        {"eval_dev_target_agreement": 0.72},
    ):
        cb.on_log(None, state, None, logs=logs)
    assert len(warned) == 2 and "target_agreement = 0.710 at step 7" in warned[0] and "29.0%" in warned[0]
    assert "so the draft learns from sequences the target never writes" in warned[0]
    assert warned[1].startswith("eval_dev_target_agreement") and "dflash-generate-labels on the validation" in warned[1]
    assert "so eval_dev_tau_est (and eval_dev_greedy_tau_est" in warned[1] and "far from the real tau" in warned[1]
    assert "Pick drafts by eval_dev_tau (real speculative decoding" in warned[1]


# ---------------------------------------------------------------------------------------------- registries
def test_unknown_loss_or_label_source_is_refused(tmp_path):
    with pytest.raises(ValueError, match="loss_type 'kl' is not registered.*'ce', 'dpace'"):
        make_loss(ObjectiveSettings(loss_type="kl"))
    with pytest.raises(ValueError, match="label_source 'argmax' is not registered"):
        make_label_source(ObjectiveSettings(label_source="argmax"))
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        DFlashTrainingArguments(loss_type="kl", **base)
    for kw, match in (
        (dict(loss_type="dpace"), "loss_type=dpace"),
        (dict(label_source="target_distribution"), "label_source=target_distribution"),
    ):
        assert DFlashTrainingArguments(**kw, **base).use_fused_linear_ce is False  # the default follows the loss
        with pytest.raises(ValueError, match=f"use_fused_linear_ce=true: {match}"):
            DFlashTrainingArguments(use_fused_linear_ce=True, **kw, **base)
    with pytest.raises(ValueError, match="dpace_alpha"):
        DFlashTrainingArguments(loss_type="dpace", dpace_alpha=0.0, **base)
    with pytest.raises(ValueError, match="label_top_k"):
        DFlashTrainingArguments(label_source="target_distribution", label_top_k=0, **base)
    with pytest.raises(ValueError, match="label_top_k 300 must be in"):
        make_label_source(ObjectiveSettings(label_source="target_distribution", label_top_k=300)).check(vocab_size=263)


# ---------------------------------------------------------------------------------------------- package shape
def _imports(path: Path, module: str) -> set[str]:
    """Package modules `module` imports anywhere in its file (function-level imports included)."""
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            found |= {name} | {f"{name}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_no_import_circle_and_module_sizes():
    files = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    graph = {m: {d for d in _imports(p, m) if d in files and d != m} for m, p in files.items()}

    def reaches(start, goal, seen):
        return any(d == goal or (d not in seen and not seen.add(d) and reaches(d, goal, seen)) for d in graph[start])

    circles = sorted(m for m in graph if reaches(m, m, set()))
    assert not circles, circles
    sizes = {m: len(p.read_text().splitlines()) for m, p in files.items()}
    # the Trainer subclass holds the Trainer's hooks; what they call lives beside it (run_start, draft_export, ...)
    assert sizes["dflash_hf.training.trainer"] < 350
    # models/ is remote code copied into every export (the checkpoint contract): not split. Everything else stays
    # small (ruff-formatted lines).
    exempt = {"dflash_hf.models.modeling_dflash", "dflash_hf.models.configuration_dflash"}
    big = {m: n for m, n in sizes.items() if n > 450 and m not in exempt}
    assert not big, big


def test_dflash2_fields_have_one_source(tmp_path):
    """Training arguments, the conversion script and the config take DFlash2's defaults and checks from
    `DFlash2Fields`; the config refuses a bad value with the field's dflash_config name."""
    import importlib.util

    from dflash_hf.models.configuration_dflash import DFlash2Fields, DFlashConfig

    defaults = DFlash2Fields().as_dict()
    args = DFlashTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert DFlash2Fields.of(args).as_dict() == defaults
    path = PACKAGE.parent / "scripts" / "convert_dflash_to_dflash2.py"
    spec = importlib.util.spec_from_file_location("convert_dflash_to_dflash2", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    parsed = script.make_parser().parse_args(["a", "b"])
    assert DFlash2Fields.of(parsed).as_dict() == defaults
    with pytest.raises(ValueError, match="selector_rank must be >= 1, got 0"):
        DFlashTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", selector_rank=0)
    tcfg = tiny_text_target(num_layers=4, hidden_size=32)[0].config
    cfg = DFlashConfig.from_target_config(
        tcfg, mask_token_id=262, variant="dflash2", num_hidden_layers=1, conv_group_size=8
    )
    assert cfg.dflash_config["conv_group_size"] == 8 and cfg.dflash_config["selector_rank"] == defaults["selector_rank"]
    with pytest.raises(ValueError, match="dflash_config.conv_kernel_size must be >= 1, got 0"):
        DFlashConfig.from_target_config(
            tcfg, mask_token_id=262, variant="dflash2", num_hidden_layers=1, conv_group_size=8, conv_kernel_size=0
        )


# ---------------------------------------------------------------------------------------------- greedy estimate
@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_greedy_estimate_scores_against_the_targets_argmax_whatever_the_label_source(
    tmp_path, text_target_4x64, variant
):
    """In evaluation (draft in eval mode) every label source scores the draft's argmax against the target's greedy
    next token as well: with ground_truth or target_distribution labels it equals target_argmax's own `correct` on
    the same plan, with target_argmax labels it is `correct` itself. In training it is not computed, and the loss
    and the other statistics are the same with it as without."""
    model, tok = text_target_4x64
    batch = text_batch(random_rows(3, 250, seed=9), tok.pad_token_id, "left")
    extra = dict(variant="dflash2", selector_top_k=4) if variant == "dflash2" else {}
    runs = {}
    for source in ("target_argmax", "ground_truth", "target_distribution"):
        trainer = _trainer(tmp_path, text_target_4x64, label_source=source, **extra)
        plan = trainer.objective.plan(trainer.target, batch, seed=0)
        trainer.model.eval()
        with torch.no_grad():
            scored = trainer.objective.loss(trainer.model, trainer.target, batch, plan)
            plain = trainer.objective.loss(trainer.model, trainer.target, batch, plan, greedy=False)
        assert scored.greedy_correct is not None and plain.greedy_correct is None
        assert scored.greedy_walk is not None and plain.greedy_walk is None
        if variant == "dflash2":  # the selector, by which DFlash2 decodes propose, is scored as well
            assert scored.selector.greedy_correct is not None and scored.selector.greedy_walk is not None
        assert torch.equal(scored.loss_sum, plain.loss_sum) and torch.equal(scored.correct, plain.correct)
        trainer.model.train()
        assert trainer.objective.loss(trainer.model, trainer.target, batch, plan).greedy_correct is None
        runs[source] = scored
    greedy = runs["target_argmax"].correct
    assert runs["target_argmax"].greedy_correct is greedy
    for source in ("ground_truth", "target_distribution"):
        assert torch.equal(runs[source].greedy_correct, greedy), source
    # the data are random tokens, which the target never writes: against them the same draft scores otherwise
    assert not torch.equal(runs["ground_truth"].blocks.labels, runs["target_argmax"].blocks.labels)


def test_greedy_tau_est_is_reported_beside_tau_est():
    """`MetricSums` reports greedy_tau_est from the greedy acceptance sums over the same blocks as tau_est."""
    from dflash_hf.objective.blocks import Blocks
    from dflash_hf.objective.losses import BlockLoss, MetricSums

    anchors = torch.tensor([[0, 5, -1]])
    valid = torch.tensor([[[True, True, True], [True, True, False], [False, False, False]]])
    correct = torch.tensor([[[True, False, True], [True, True, False], [False, False, False]]])
    greedy = torch.tensor([[[True, True, True], [False, True, False], [False, False, False]]])
    zeros = torch.zeros(1, 3, 3, dtype=torch.long)
    blocks = Blocks(anchors, zeros.new_zeros(1, 3, 4), zeros.new_zeros(1, 3, 4), zeros, valid, valid.float())
    out = BlockLoss(torch.tensor(1.0), torch.tensor(2.0), correct, blocks, greedy_correct=greedy)
    sums = MetricSums(prefix="eval_")
    sums.add_block_loss(out)
    metrics = sums.reduce()
    assert metrics["eval_tau_est"] == 1.0 + (1 + 2) / 2  # runs of 1 and 2 over two blocks
    assert metrics["eval_greedy_tau_est"] == 1.0 + (3 + 0) / 2
    assert "eval_greedy_walk_tau_est" not in metrics  # no walk given
    out.greedy_walk = (7, 2)
    sums = MetricSums(prefix="eval_")
    sums.add_block_loss(out)
    assert sums.reduce()["eval_greedy_walk_tau_est"] == 3.5
    out.greedy_correct = None  # training statistics: no greedy sums, no greedy_tau_est
    sums = MetricSums()
    sums.add_block_loss(out)
    assert "greedy_tau_est" not in sums.reduce()


def test_greedy_slot_correct_reads_the_greedy_token_at_each_slots_position():
    """Slot k of the block at anchor a compares the draft's argmax with the greedy token at a+k; invalid slots (past
    the row, unused anchors) are False."""
    from dflash_hf.objective.blocks import Blocks
    from dflash_hf.objective.greedy import greedy_slot_correct

    greedy_ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    anchors = torch.tensor([[1, 4, -1]])
    valid = torch.tensor([[[True, True, True], [True, False, False], [False, False, False]]])
    zeros = torch.zeros(1, 3, 3, dtype=torch.long)
    blocks = Blocks(anchors, zeros.new_zeros(1, 3, 4), zeros.new_zeros(1, 3, 4), zeros, valid, valid.float())
    predictions = torch.tensor([12, 99, 14, 15])  # valid slots in order: (a=1: k=1,2,3), (a=4: k=1)
    expected = torch.tensor([[[True, False, True], [True, False, False], [False, False, False]]])
    assert torch.equal(greedy_slot_correct(predictions, greedy_ids, blocks), expected)


def test_decode_walk_follows_the_cycles_a_decode_would_run():
    """From each response's first token, cycle after cycle by each block's acceptance length, cut at the response's
    last token: tokens / cycles is the real tau of those decodes. A response whose walk reaches an anchor that was
    not drawn is left out; packed documents are walked apart."""
    from dflash_hf.objective.losses.metrics import acceptance_lengths, decode_walk

    correct = torch.tensor([[[True, True, False], [False, True, True]]])
    assert acceptance_lengths(correct).tolist() == [[3, 1]]
    #            positions: 0  1  2  3  4  5  6  7  8  9
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 0, -1]])
    anchors = torch.tensor([[2, 3, 4, 5, 6]])
    lengths = torch.tensor([[3, 9, 1, 4, 9]])
    # 2 -> keeps 3 -> 5 -> keeps min(4, 7 - 5) = 2 -> 7, the last supervised token: 5 tokens in 2 cycles
    assert decode_walk(anchors, lengths, loss_mask, doc_ids) == (5, 2)
    assert decode_walk(anchors[:, 1:], lengths[:, 1:], loss_mask, doc_ids) == (0, 0)  # no anchor at 2: left out
    # two packed documents of one row: [1, 3] and [5, 8]
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    doc_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    anchors = torch.tensor([[1, 2, 5, 6, 7]])
    lengths = torch.tensor([[1, 1, 2, 1, 1]])
    assert decode_walk(anchors, lengths, loss_mask, doc_ids) == (2 + 3, 2 + 2)  # 1,2 | 5->7, 7->8
