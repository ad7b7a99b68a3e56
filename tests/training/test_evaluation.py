"""Validate-only, real tau during training, TensorBoard logging, the concise progress bar and the plots."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch
from tqdm.auto import tqdm
from transformers import ProgressCallback, TrainerControl, TrainerState
from utils import REPO_ROOT, ListDataset, make_args, random_rows, text_batch, tiny_text_target

from dflash_hf import DFlashTrainer, DFlashTrainingArguments
from dflash_hf.testing import tiny
from dflash_hf.training.callbacks import DFlashProgressCallback, RealTauCallback
from dflash_hf.training.validate_only import VALIDATION_METRICS_FILE, validate

BLOCK = 4


@pytest.fixture(scope="module")
def target():
    return tiny_text_target(num_layers=4, hidden_size=64, seed=1)


def _args(out: Path, tok, **kw) -> DFlashTrainingArguments:
    """`make_args` with this file's run: output in `out`, a 1-layer draft, 3 steps, target-argmax labels."""
    base = dict(
        output_dir=str(out),
        mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN),
        block_size=BLOCK,
        num_draft_layers=1,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=3,
        max_steps=3,
        num_anchors=8,
        label_source="target_argmax",
        target_argmax_chunk_size=16,
        learning_rate=3e-3,
    )
    return make_args(out, **(base | kw))


def _data(tok):
    rows = random_rows(12, 256, seed=0)
    collate = lambda items: text_batch(items, tok.pad_token_id, "left")  # noqa: E731
    evals = {"dev": ListDataset(random_rows(5, 256, seed=1)), "test": ListDataset(random_rows(4, 256, seed=2))}
    return ListDataset(rows), evals, collate


@pytest.mark.slow  # 5 s on 2 busy cores
def test_validate_only_equals_evaluation_inside_training(target, tmp_path, capsys):
    model, tok = target
    train, evals, collate = _data(tok)
    args = _args(tmp_path / "run", tok, eval_strategy="steps", eval_steps=3)
    torch.manual_seed(0)
    trainer = DFlashTrainer(args=args, target=model, train_dataset=train, eval_dataset=evals, data_collator=collate)
    trainer.train()
    in_training = next(e for e in trainer.state.log_history if "eval_dev_loss" in e)
    in_training.update(next(e for e in trainer.state.log_history if "eval_test_loss" in e))
    assert in_training["step"] == 3
    export = tmp_path / "export"
    trainer.save_model(str(export))

    val_args = _args(tmp_path / "val", tok, validate_only=True, init_from_pretrained=str(export))
    metrics = validate(val_args, evals, target=model, data_collator=collate)
    keys = sorted(k for k in metrics if k.startswith("eval_") and not k.endswith("_runtime"))
    for name in ("dev", "test"):
        for m in ("loss", "tau_est", "accuracy", *(f"acc_slot{k}" for k in range(1, BLOCK))):
            assert f"eval_{name}_{m}" in keys
    assert {k: metrics[k] for k in keys} == {k: in_training[k] for k in keys}
    assert 1.0 <= metrics["eval_dev_tau_est"] <= BLOCK
    saved = json.loads((tmp_path / "val" / VALIDATION_METRICS_FILE).read_text())
    assert saved == pytest.approx(metrics)
    table = capsys.readouterr().out
    assert "dev" in table and "test" in table and f"{metrics['eval_dev_loss']:.4f}" in table
    # a different draft gives different metrics (the comparison above can fail)
    other = validate(
        _args(tmp_path / "val2", tok),
        evals,
        target=model,
        data_collator=collate,
        draft=trainer.model.__class__(trainer.model.config),
    )
    assert other["eval_dev_loss"] != metrics["eval_dev_loss"]


def test_validate_refuses_missing_draft_and_sets(target, tmp_path):
    model, tok = target
    _, evals, collate = _data(tok)
    with pytest.raises(ValueError, match="init_from_pretrained"):
        validate(_args(tmp_path, tok), evals, target=model, data_collator=collate)
    with pytest.raises(ValueError, match="eval_datasets"):
        validate(_args(tmp_path, tok), {}, target=model)


def test_a_validate_only_run_without_a_draft_stops_before_the_row_checks_and_the_target(tmp_path, monkeypatch):
    """`run_training` with `validate_only` and no `init_from_pretrained`: the error comes before the data rows are
    read and the target loads."""
    from dflash_hf.targets import builder
    from dflash_hf.training import row_preflight
    from dflash_hf.training.run import run_training
    from dflash_hf.training.training_args import DFlashDataArguments

    def expensive(*args, **kwargs):
        raise AssertionError("reached before the missing draft was named")

    monkeypatch.setattr(row_preflight, "check_data_rows", expensive)
    monkeypatch.setattr(builder, "load_frozen_target", expensive)
    (tmp_path / "target").mkdir()
    manifest = tmp_path / "dev.jsonl"
    manifest.write_text(json.dumps({"audio_filepath": "a.wav", "text": "a", "duration": 1.0}) + "\n")
    args = make_args(tmp_path, validate_only=True, target_name_or_path=str(tmp_path / "target"))
    with pytest.raises(ValueError, match="validate_only evaluates a trained draft: set init_from_pretrained"):
        run_training(args, DFlashDataArguments(eval_data=[f"dev={manifest}"]))


@pytest.mark.slow  # 9 s on 2 busy cores
def test_training_logs_tensorboard_real_tau_and_plots(target, tmp_path):
    """One short run: real tau every 2 steps, report_to=tensorboard; then plot_training on both sources."""
    model, tok = target
    train, evals, collate = _data(tok)
    logdir = tmp_path / "run" / "runs"  # TensorBoardCallback's default: <output_dir>/runs/<date_host>
    args = _args(
        tmp_path / "run",
        tok,
        max_steps=4,
        logging_steps=1,
        report_to="tensorboard",
        real_tau_steps=2,
        real_tau_samples=2,
        real_tau_max_new_tokens=8,
        eval_strategy="steps",
        eval_steps=4,
        disable_tqdm=False,
    )
    torch.manual_seed(0)
    trainer = DFlashTrainer(
        args=args, target=model, train_dataset=train, eval_dataset=evals["dev"], data_collator=collate
    )
    callbacks = trainer.callback_handler.callbacks
    assert any(isinstance(c, DFlashProgressCallback) for c in callbacks)
    assert not any(type(c) is ProgressCallback for c in callbacks)
    real = next(c for c in callbacks if isinstance(c, RealTauCallback))
    prompts = real.prompts()["eval_"]
    assert [p["input_ids"][0].tolist() for p in prompts] == [r[0] for r in evals["dev"].rows[:2]]
    trainer.train()
    taus = [(e["step"], e["eval_tau"]) for e in trainer.state.log_history if "eval_tau" in e]
    assert [s for s, _ in taus] == [2, 4]
    minutes = [e["train_minutes"] for e in trainer.state.log_history]  # every log: the x of a tau-minutes curve
    assert minutes == sorted(minutes) and minutes[-1] > 0
    assert all(1.0 <= t <= BLOCK for _, t in taus), taus

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(logdir.rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/tau_est", "train/acc_slot1", "eval/loss", "eval/tau_est", "eval/tau"):
        assert tag in tags, sorted(tags)
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(logged, rel=1e-5)

    spec = importlib.util.spec_from_file_location("plot_training", REPO_ROOT / "scripts" / "plot_training.py")
    plot_training = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_training)
    assert plot_training.main([str(logdir), "--out_dir", str(tmp_path / "tb_plots")]) == 0
    trainer.save_state()
    assert plot_training.main([str(tmp_path / "run"), "--source", "trainer_state"]) == 0
    for out in (tmp_path / "tb_plots", tmp_path / "run" / "plots"):
        for name in ("loss", "accuracy", "tau_est", "tau"):
            png = out / f"{name}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        plot_training.main([str(logdir), "--source", "trainer_state"])


def test_train_minutes_go_on_from_the_resumed_checkpoints_log():
    from dflash_hf.training.reporting import TrainClock

    clock = TrainClock()
    assert clock.entries() == {}  # before the loop (a validate-only evaluation): no such key
    clock.begin([{"loss": 1.0, "train_minutes": 2.5}, {"eval_loss": 1.0, "train_minutes": 2.75}, {"loss": 0.9}])
    assert 2.75 <= clock.entries()["train_minutes"] < 2.8


def test_progress_bar_postfix_is_concise(capsys):
    cb = DFlashProgressCallback()
    cb.training_bar = tqdm(total=10, file=io.StringIO())
    state, control = TrainerState(), TrainerControl()
    cb.on_log(None, state, control, logs={"loss": 1.234567, "tau_est": 2.5, "acc_slot1": 0.5, "learning_rate": 1e-3})
    assert cb.postfix == {"loss": "1.235", "tau_est": "2.5"}
    cb.on_log(None, state, control, logs={"eval_dev_tau": 3.25})
    assert cb.postfix["dev_tau"] == "3.25"
    assert capsys.readouterr().out == ""  # training logs only update the postfix
    cb.on_log(None, state, control, logs={"eval_dev_loss": 2.0, "eval_dev_tau_est": 1.5, "eval_dev_acc_slot1": 0.1})
    line = capsys.readouterr().out
    assert "eval_dev_loss=2" in line and "eval_dev_tau_est=1.5" in line and "acc_slot1" not in line
    cb.on_log(None, state, control, logs={"eval_dev_loss": 2.0, "eval_dev_tau_est": 1.5, "eval_dev_tau": 1.25})
    assert capsys.readouterr().out.split(": ", 1)[1].startswith("eval_dev_tau=1.25, ")  # the real tau first
    cb.training_bar.close()


@pytest.mark.slow  # 6 s on 2 busy cores
def test_real_tau_prompts_use_the_trainers_family_and_padding_side(tmp_path):
    """The real-tau callback renders speech prompts with the trainer's target family (here the model-side single
    placeholder row, whose config also matches the processor-expanding qwen2_audio row) and the data arguments'
    padding side, as the training loader does; then decodes them."""
    from utils import TESTS_DIR, loaded_script

    with loaded_script(TESTS_DIR / "targets" / "test_families.py") as families:  # a helper of another folder
        build_qwen2_audio = families.build_qwen2_audio

    from dflash_hf.targets.families.base import audio_token_id
    from dflash_hf.training.training_args import DFlashDataArguments

    tok = tiny.build_tokenizer()
    torch.manual_seed(0)
    model, processor = build_qwen2_audio(tok)
    manifest = tiny.synthesize_speech(tmp_path / "speech", 2, seed=4, min_dur=0.6, max_dur=1.0)
    args = _args(
        tmp_path / "out",
        tok,
        target_family="qwen2_audio_single_placeholder",
        real_tau_steps=1,
        real_tau_samples=2,
        real_tau_max_new_tokens=4,
        target_layer_ids=[0, 1],
    )
    trainer = DFlashTrainer(
        args=args,
        target=model,
        processor=processor,
        eval_dataset=[str(manifest)],
        data_args=DFlashDataArguments(prompt="Transcribe.", padding_side="right"),
    )
    real = next(c for c in trainer.callback_handler.callbacks if isinstance(c, RealTauCallback))
    _, collate = trainer.real_tau._rows_and_collator([str(manifest)])
    assert collate.family is trainer.target.family and collate.padding_side == "right"
    placeholder = audio_token_id(trainer.target.family, model.config)
    prompts = real.prompts()["eval_"]
    assert len(prompts) == 2
    assert all(int((p["input_ids"] == placeholder).sum()) == 1 for p in prompts)  # one placeholder per audio
    assert 1.0 <= real.measure()["eval_tau"] <= BLOCK


@pytest.mark.slow  # 8 s on 2 busy cores
def test_early_stopping_stops_on_the_metric_and_exports_the_best_checkpoint(target, tmp_path):
    model, tok = target
    train, evals, collate = _data(tok)
    # a threshold no tau_est gain can pass: the second evaluation does not count as better, so training stops there
    args = _args(
        tmp_path / "run",
        tok,
        max_steps=12,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="dev_tau_est",
        early_stopping_patience=1,
        early_stopping_threshold=100.0,
    )
    torch.manual_seed(0)
    trainer = DFlashTrainer(args=args, target=model, train_dataset=train, eval_dataset=evals, data_collator=collate)
    trainer.train()
    assert trainer.state.global_step == 4  # not 12
    assert args.greater_is_better  # tau_est: higher is better
    taus = {e["step"]: e["eval_dev_tau_est"] for e in trainer.state.log_history if "eval_dev_tau_est" in e}
    best_step = max(taus, key=taus.get)
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")
    assert trainer.state.best_metric == taus[best_step]
    # the trainer's draft is the best checkpoint's (load_best_model_at_end), so an export is that draft
    from safetensors.torch import load_file

    best = load_file(str(Path(trainer.state.best_model_checkpoint) / "model.safetensors"))
    for name, value in trainer.model.state_dict().items():
        torch.testing.assert_close(value, best[name], rtol=0, atol=0, msg=name)
    assert trainer.final_eval_metrics()["eval_dev_tau_est"] == pytest.approx(taus[best_step])


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(load_best_model_at_end=True), r"metric_for_best_model .*'loss' \(transformers default\).*dev_tau_est"),
        (dict(save_strategy="best", metric_for_best_model="dev_tau"), r"--save_strategy best: .*got 'dev_tau'"),
        (dict(early_stopping_patience=2, metric_for_best_model="tau_est"), "got 'tau_est'"),
        (dict(early_stopping_patience=2, metric_for_best_model="dev_selector_tau_est"), "dflash2|got"),
        (dict(early_stopping_patience=2, metric_for_best_model="dev_tau_est", eval_strategy="no"), "eval_strategy"),
        (dict(metric_for_best_model="dev_tau"), r"--metric_for_best_model: .*got 'dev_tau'"),  # tracked on its own
        (
            dict(load_best_model_at_end=True, metric_for_best_model="dev_tau_est", save_steps=4),
            "may have no checkpoint to load: set --save_steps 2",
        ),
    ],
)
def test_best_model_settings_naming_no_reported_metric_are_refused_before_training(target, tmp_path, kw, message):
    model, tok = target
    train, evals, collate = _data(tok)
    base = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2)
    with pytest.raises(ValueError, match=message):
        DFlashTrainer(
            args=_args(tmp_path, tok, **(base | kw)),
            target=model,
            train_dataset=train,
            eval_dataset=evals,
            data_collator=collate,
        )
    assert not (tmp_path / "checkpoint-2").exists()


def test_early_stopping_settings_are_checked_with_the_arguments(tmp_path):
    for bad, message in (
        (dict(early_stopping_patience=0), "early_stopping_patience must be >= 1"),
        (dict(early_stopping_threshold=-1.0), "early_stopping_threshold must be >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            make_args(tmp_path, mask_token_id=5, **bad)


@pytest.mark.slow  # 7 s on 2 busy cores
def test_a_resumed_run_stops_early_at_the_step_the_uninterrupted_one_did(target, tmp_path):
    model, tok = target
    train, evals, collate = _data(tok)

    def trainer(name: str) -> DFlashTrainer:
        # patience 2 with an impassable threshold: evaluations at 2 (best), 4 (1 without gain), 6 (2: stop)
        args = _args(
            tmp_path / name,
            tok,
            max_steps=12,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=2,
            metric_for_best_model="dev_tau_est",
            early_stopping_patience=2,
            early_stopping_threshold=100.0,
        )
        torch.manual_seed(0)
        return DFlashTrainer(args=args, target=model, train_dataset=train, eval_dataset=evals, data_collator=collate)

    straight = trainer("a")
    straight.train()
    assert straight.state.global_step == 6
    resumed = trainer("b")
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))  # its counter: 1
    assert resumed.state.global_step == 6  # not 8, as a counter restarted at 0 would give
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    after_stop = trainer("c")  # from the checkpoint where it stopped: no step (transformers would take one more)
    after_stop.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-6"))
    assert after_stop.state.global_step == 6 and after_stop.trains_no_step
    for (name, a), b in zip(straight.model.state_dict().items(), after_stop.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_the_metric_check_reads_the_drafts_variant_and_block_size(target, tmp_path):
    model, tok = target
    train, evals, collate = _data(tok)
    kw = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2)
    built = DFlashTrainer(
        args=_args(tmp_path / "a", tok, variant="dflash2", **kw),
        target=model,
        train_dataset=train,
        eval_dataset=evals,
        data_collator=collate,
    )
    # the same DFlash2 draft handed to a trainer whose arguments keep the defaults: its selector metrics are reported
    args = _args(tmp_path / "b", tok, early_stopping_patience=1, metric_for_best_model="dev_selector_tau_est", **kw)
    DFlashTrainer(
        model=built.model, args=args, target=model, train_dataset=train, eval_dataset=evals, data_collator=collate
    )


def test_best_model_and_early_stopping_can_follow_the_greedy_estimate(target, tmp_path):
    """--metric_for_best_model dev_greedy_tau_est (reported whatever the label source) selects the best checkpoint
    and drives early stopping, here with ground_truth labels (tau_est against the data's tokens)."""
    model, tok = target
    train, evals, collate = _data(tok)
    args = _args(
        tmp_path / "run",
        tok,
        label_source="ground_truth",
        max_steps=12,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="dev_greedy_tau_est",
        early_stopping_patience=1,
        early_stopping_threshold=100.0,
    )
    torch.manual_seed(0)
    trainer = DFlashTrainer(args=args, target=model, train_dataset=train, eval_dataset=evals, data_collator=collate)
    trainer.train()
    assert trainer.state.global_step == 4 and args.greater_is_better
    logged = [e for e in trainer.state.log_history if "eval_dev_greedy_tau_est" in e]
    assert len(logged) == 2
    greedy = {e["step"]: e["eval_dev_greedy_tau_est"] for e in logged}
    best_step = max(greedy, key=greedy.get)
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")
    assert trainer.state.best_metric == greedy[best_step]


def _greedy_rows(model, prompts: list[torch.Tensor], length: int, every: int, generator) -> list[tuple]:
    """(prompt, the target's greedy continuation); with `every`, each `every`-th token is a random one instead (the
    continuation then goes on greedily from it): data the target agrees with except at those tokens, as references
    normalized otherwise than the target writes them."""
    rows = []
    for p in prompts:
        ids = p[None].clone()
        for i in range(length):
            with torch.no_grad():
                nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            if every and i % every == every - 1:
                nxt = int(torch.randint(3, 250, (1,), generator=generator))
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        rows.append((p.tolist(), ids[0, len(p) :].tolist()))
    return rows


@pytest.mark.slow
def test_greedy_tau_est_tracks_real_greedy_acceptance_where_the_data_disagrees_with_the_target(target, tmp_path):
    """A draft taught the target's own next tokens, measured on a manifest whose text disagrees with the target at
    every fifth token: the configured estimate (ground_truth labels, against the manifest's text) stays far below
    the real tau of greedy speculative decoding, the greedy estimate follows it. The greedy estimate is exactly
    tau_est with target_argmax labels (same draft, data and anchors)."""
    from dflash_hf.generation.evaluation import decode_benchmark

    model, tok = target
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (8,), generator=g) for _ in range(8)]
    own = _greedy_rows(model, prompts, 24, 0, g)
    manifest = _greedy_rows(model, prompts, 24, 5, g)
    collate = lambda items: text_batch(items, tok.pad_token_id, "right")  # noqa: E731
    kw = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, num_anchors=64, max_steps=150)
    torch.manual_seed(0)
    teach = DFlashTrainer(
        args=_args(tmp_path / "teach", tok, **kw),  # target_argmax labels: the target's own next tokens
        target=model,
        train_dataset=ListDataset(own + manifest),
        data_collator=collate,
    )
    teach.train()
    draft = teach.model.eval()

    def measured():
        on_text = DFlashTrainer(
            model=draft,
            args=_args(tmp_path / "gt", tok, label_source="ground_truth", **kw),
            target=model,
            eval_dataset={"manifest": ListDataset(manifest)},
            data_collator=collate,
        ).evaluate()
        on_target = teach.evaluate(eval_dataset=ListDataset(manifest))
        inputs = [{"input_ids": p[None], "attention_mask": torch.ones(1, 8, dtype=torch.long)} for p in prompts]
        real = decode_benchmark(draft, teach.target, inputs, 24).tau
        return on_text["eval_manifest_tau_est"], on_text["eval_manifest_greedy_tau_est"], on_target, real

    tau_est, greedy_tau_est, on_target, real = measured()
    assert greedy_tau_est == on_target["eval_tau_est"] == on_target["eval_greedy_tau_est"]
    assert real > 3.0  # the draft learned the target's greedy continuations
    assert abs(greedy_tau_est - real) < 0.5 < real - tau_est - 0.4  # the greedy estimate follows, tau_est does not


@pytest.mark.slow
def test_greedy_walk_tau_est_is_the_real_tau_on_the_targets_own_outputs(target, tmp_path):
    """On the target's own greedy continuations, walking each response cycle by cycle over the blocks' greedy
    acceptance gives exactly the real tau of greedy speculative decoding of the same prompts, where tau_est (an
    average over positions) does not: a stretch the draft gets wrong costs a cycle per token, an easy stretch one
    cycle in all, which a per-position average weighs otherwise."""
    from dflash_hf.generation.evaluation import decode_benchmark

    model, tok = target
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (8,), generator=g) for _ in range(8)]
    own = _greedy_rows(model, prompts, 40, 0, g)
    varied = _greedy_rows(model, prompts, 40, 3, g)  # more contexts to learn from
    collate = lambda items: text_batch(items, tok.pad_token_id, "right")  # noqa: E731
    kw = dict(block_size=8, per_device_train_batch_size=4, per_device_eval_batch_size=8, num_anchors=512)
    torch.manual_seed(0)
    trainer = DFlashTrainer(
        args=_args(tmp_path, tok, max_steps=10, **kw),
        target=model,
        train_dataset=ListDataset(own + varied),
        data_collator=collate,
    )
    trainer.train()
    trainer.args.eval_real_tau, trainer.args.real_tau_samples, trainer.args.real_tau_max_new_tokens = True, 8, 40
    metrics = trainer.evaluate(eval_dataset=ListDataset(own))
    inputs = [{"input_ids": p[None], "attention_mask": torch.ones(1, 8, dtype=torch.long)} for p in prompts]
    real = decode_benchmark(trainer.model.eval(), trainer.target, inputs, 40).tau
    assert metrics["eval_greedy_walk_tau_est"] == pytest.approx(real, abs=1e-9)
    assert metrics["eval_tau"] == pytest.approx(real, abs=1e-12) and real > 2.0  # the evaluation's real decoding
    assert metrics["eval_tau_est"] - real > 1.0  # the per-position estimate is far off


def test_every_evaluation_reports_the_real_tau_first_and_drafts_can_be_picked_by_it(target, tmp_path):
    """--eval_real_tau (the default of dflash-train): each evaluation decodes the set's first real_tau_samples prompts
    speculatively and reports eval_<set>_tau first, the real tau of exactly those prompts; --metric_for_best_model
    dev_tau picks the checkpoint by it."""
    from dflash_hf.generation.evaluation import decode_benchmark
    from dflash_hf.training.best_model import check_best_model_args, eval_prefixes

    model, tok = target
    train, evals, collate = _data(tok)
    kw = dict(eval_real_tau=True, real_tau_samples=3, real_tau_max_new_tokens=6, max_steps=2, eval_strategy="steps")
    args = _args(tmp_path / "run", tok, **kw, eval_steps=1, save_strategy="steps", save_steps=1)
    args.load_best_model_at_end, args.metric_for_best_model = True, "dev_tau"
    check_best_model_args(args, eval_prefixes(evals))  # a metric the evaluation reports
    torch.manual_seed(0)
    trainer = DFlashTrainer(args=args, target=model, train_dataset=train, eval_dataset=evals, data_collator=collate)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "eval_dev_loss" in e]
    assert [next(iter(e)) for e in logged] == ["eval_dev_tau"] * 2  # first among the set's metrics
    taus = {e["step"]: e["eval_dev_tau"] for e in logged}
    assert trainer.state.best_metric == max(taus.values())
    metrics = trainer.evaluate()
    prompts = [
        {"input_ids": torch.tensor([r[0]]), "attention_mask": torch.ones(1, len(r[0]), dtype=torch.long)}
        for r in evals["dev"].rows[:3]
    ]
    real = decode_benchmark(trainer.model.eval(), trainer.target, prompts, 6, compare_greedy=False).tau
    assert metrics["eval_dev_tau"] == pytest.approx(real, abs=1e-12) and "eval_test_tau" in metrics
    off = _args(tmp_path / "off", tok, **{**kw, "eval_real_tau": False}, eval_steps=1, save_steps=1)
    off.load_best_model_at_end, off.metric_for_best_model = True, "dev_tau"
    with pytest.raises(ValueError, match="must name a metric the validation reports, got 'dev_tau'"):
        check_best_model_args(off, eval_prefixes(evals))


def test_real_tau_is_decoded_once_at_a_step_that_is_also_evaluated(target, tmp_path, monkeypatch):
    """--real_tau_steps 1 with an evaluation every 2 steps (--eval_real_tau): step 1's real tau comes from the
    callback, step 2's from the evaluation alone, the same prompts decoded once a step."""
    from dflash_hf.training import estimates

    model, tok = target
    train, evals, collate = _data(tok)
    decodes = []
    real_decode = estimates.decode_benchmark
    monkeypatch.setattr(estimates, "decode_benchmark", lambda *a, **k: decodes.append(1) or real_decode(*a, **k))
    kw = dict(eval_real_tau=True, real_tau_steps=1, real_tau_samples=2, real_tau_max_new_tokens=4, max_steps=2)
    args = _args(tmp_path, tok, **kw, eval_strategy="steps", eval_steps=2)
    torch.manual_seed(0)
    trainer = DFlashTrainer(
        args=args, target=model, train_dataset=train, eval_dataset=evals["dev"], data_collator=collate
    )
    trainer.train()
    taus = [(e["step"], "eval_loss" in e) for e in trainer.state.log_history if "eval_tau" in e]
    assert taus == [(1, False), (2, True)] and len(decodes) == 2


def test_real_tau_reads_a_validation_path_with_the_rate_its_loss_loader_applies(tmp_path):
    """A validation set given as a path: its real-tau prompts are read with the data arguments'
    `max_chars_per_second`, as its loss loader reads it (a row one refuses, the other does too)."""
    import json

    from dflash_hf.data import BadSampleError
    from dflash_hf.training.training_args import DFlashDataArguments

    tok = tiny.build_tokenizer()
    model, processor = tiny.build_qwen3_asr_target(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    manifest = tiny.synthesize_speech(tmp_path / "speech", 2, seed=0, max_dur=0.8)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    rows[1]["text"] = "An answer much longer than anything said in the clip. " * 2
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for rate, kept in ((50.0, None), (0.0, 2)):
        trainer = DFlashTrainer(
            args=_args(tmp_path / f"out{rate}", tok, target_layer_ids=[0, 1]),
            target=model,
            processor=processor,
            eval_dataset=[str(manifest)],
            data_args=DFlashDataArguments(prompt="Transcribe.", max_chars_per_second=rate),
        )
        rows_read, _ = trainer.real_tau._rows_and_collator([str(manifest)])
        if kept:
            assert len(list(rows_read)) == kept
        else:
            with pytest.raises(BadSampleError, match="more than --max_chars_per_second 50"):
                list(rows_read)
