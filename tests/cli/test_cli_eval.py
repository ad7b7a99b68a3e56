"""`dflash-eval`: tau and tokens/s of speculative vs target greedy decoding on tiny text and speech targets."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.cli import eval as cli_eval
from dflash_hf.data import eval_rows
from dflash_hf.export import evaluation_setup
from dflash_hf.generation import evaluation
from dflash_hf.targets.frozen import FrozenTarget, load_target
from dflash_hf.testing import tiny

BLOCK = 4


def _save_draft(target_dir, out_dir):
    ft = FrozenTarget(load_target(str(target_dir)))
    mask_id = tiny.build_tokenizer().convert_tokens_to_ids(tiny.MASK_TOKEN)
    cfg = DFlashConfig.from_target_config(ft.text_config, mask_token_id=mask_id, num_hidden_layers=1, block_size=BLOCK)
    torch.manual_seed(0)
    DFlashDraftModel(cfg).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    target = tiny.save_tiny_target(
        root / "target", kind="text", hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1
    )
    draft = _save_draft(target, root / "draft")
    prompts = root / "prompts.jsonl"
    lines = [
        {"prompt": "hello world"},
        {"messages": [{"role": "user", "content": "count to ten"}]},
        {"prompt": "the quick brown fox"},
    ]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root, target, draft, prompts


def test_text_prompts_config_and_overrides(text_setup, capsys):
    root, target, draft, prompts = text_setup
    config = root / "eval.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "draft": str(draft),
                "target": str(target),
                "data": str(prompts),
                "max_new_tokens": 20,
                "output_json": str(root / "out.json"),
                "overwrite_output_json": True,  # each run below replaces the results of the one before
            }
        )
    )
    assert cli_eval.main(["--config", str(config), "--max_new_tokens", "10"]) == 0
    res = json.loads((root / "out.json").read_text())
    assert res["max_new_tokens"] == 10  # the command line overrides the YAML
    assert res["prompts"] == 3 and res["outputs_identical"] and res["mismatched_prompts"] == []
    assert res["cycles"] > 0 and 1.0 <= res["tau"] <= BLOCK
    assert res["spec_tokens"] == res["greedy_tokens"] == 30  # no eos from the random target within 10 tokens
    assert res["spec_tokens_per_s"] > 0 and res["greedy_tokens_per_s"] > 0
    out = capsys.readouterr().out
    assert "speculative" in out and "target greedy" in out and "outputs identical: yes" in out
    assert res["draft_step"] == "eager" and "draft step eager" in out  # auto on the CPU
    assert res["verify_step"] == "eager" and "verify eager" in out  # auto on the CPU: the growing cache
    # the fixed-shape draft step (a CUDA graph on a GPU) on the CPU: the same proposals, so the same cycles
    assert cli_eval.main(["--config", str(config), "--max_new_tokens", "10", "--draft_cuda_graph", "on"]) == 0
    fixed = json.loads((root / "out.json").read_text())
    assert fixed["draft_step"] == "fixed-shape, no graph" and fixed["outputs_identical"]
    assert (fixed["cycles"], fixed["tau"]) == (res["cycles"], res["tau"])
    assert cli_eval.main(["--config", str(config), "--max_new_tokens", "10", "--verify_cuda_graph", "on"]) == 0
    fixed = json.loads((root / "out.json").read_text())
    assert fixed["verify_step"] == "fixed-shape, no graph" and fixed["outputs_identical"]
    assert (fixed["cycles"], fixed["tau"]) == (res["cycles"], res["tau"])
    with pytest.raises(ValueError, match="--draft_cuda_graph must be one of"):
        cli_eval.main(["--config", str(config), "--draft_cuda_graph", "yes"])
    with pytest.raises(ValueError, match="--verify_cuda_graph must be one of"):
        cli_eval.main(["--config", str(config), "--verify_cuda_graph", "yes"])


def test_mismatch_fails_and_bad_inputs_are_named(text_setup, monkeypatch):
    root, target, draft, prompts = text_setup
    real = evaluation.speculative_generate

    def corrupted(*a, **kw):
        out = real(*a, **kw)
        out.sequences[0, -1] = (out.sequences[0, -1] + 1) % 256
        return out

    monkeypatch.setattr(evaluation, "speculative_generate", corrupted)
    argv = [
        "--draft",
        str(draft),
        "--target",
        str(target),
        "--data",
        str(prompts),
        "--max_new_tokens",
        "4",
        "--num_samples",
        "2",
        "--output_json",
        str(root / "bad.json"),
    ]
    assert cli_eval.main(argv) == 1
    res = json.loads((root / "bad.json").read_text())
    assert res["prompts"] == 2 and not res["outputs_identical"] and res["mismatched_prompts"] == [0, 1]
    assert cli_eval.main(argv + ["--allow_mismatch", "true", "--overwrite_output_json", "true"]) == 0
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="--data"):
        cli_eval.main(["--draft", str(draft), "--target", str(target), "--data", str(root / "missing.jsonl")])
    bad = root / "bad_prompts.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no key"}) + "\n")
    with pytest.raises(ValueError, match="line 2: needs a 'prompt'"):
        cli_eval.main(
            [
                "--draft",
                str(draft),
                "--target",
                str(target),
                "--data",
                str(bad),
                "--max_new_tokens",
                "2",
                "--output_json",
                str(root / "x.json"),
            ]
        )


def test_speech_manifest(tmp_path):
    target = tiny.save_tiny_target(
        tmp_path / "asr", kind="qwen3_asr", hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1
    )
    draft = _save_draft(target, tmp_path / "draft")
    manifest = tiny.synthesize_speech(tmp_path / "speech", num_utterances=2, max_dur=0.8)
    out = tmp_path / "res.json"
    assert (
        cli_eval.main(
            [
                "--draft",
                str(draft),
                "--target",
                str(target),
                "--data",
                str(manifest),
                "--max_new_tokens",
                "8",
                "--prompt",
                "Transcribe.",
                "--output_json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["prompts"] == 2 and res["outputs_identical"] and 1.0 <= res["tau"] <= BLOCK
    # the fixed-shape step with a prompt of audio positions longer than a block (its one-forward prefill)
    assert (
        cli_eval.main(
            [
                "--draft",
                str(draft),
                "--target",
                str(target),
                "--data",
                str(manifest),
                "--max_new_tokens",
                "8",
                "--prompt",
                "Transcribe.",
                "--output_json",
                str(out),
                "--overwrite_output_json",
                "true",
                "--draft_cuda_graph",
                "on",
            ]
        )
        == 0
    )
    fixed = json.loads(out.read_text())
    assert fixed["outputs_identical"] and (fixed["cycles"], fixed["tau"]) == (res["cycles"], res["tau"])
    text_prompts = tmp_path / "p.jsonl"
    text_prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match="speech model"):
        cli_eval.main(["--draft", str(draft), "--target", str(target), "--data", str(text_prompts)])


def test_single_placeholder_row(tmp_path):
    """--family qwen2_audio_single_placeholder decodes with the model-side row, and the greedy baseline is the
    target's own cached loop (transformers' generate cannot run that row's audio merge): outputs identical."""
    from utils import TESTS_DIR, loaded_script

    with loaded_script(TESTS_DIR / "targets" / "test_families.py") as families:  # a helper of another folder
        save_qwen2_audio = families.save_qwen2_audio

    save_qwen2_audio(tmp_path / "target")
    draft = _save_draft(tmp_path / "target", tmp_path / "draft")
    manifest = tiny.synthesize_speech(tmp_path / "speech", num_utterances=2, max_dur=0.8)
    out = tmp_path / "res.json"
    argv = [
        "--draft",
        str(draft),
        "--target",
        str(tmp_path / "target"),
        "--data",
        str(manifest),
        "--max_new_tokens",
        "8",
        "--prompt",
        "Transcribe.",
        "--output_json",
        str(out),
    ]
    assert cli_eval.main(argv + ["--family", "qwen2_audio_single_placeholder"]) == 0
    res = json.loads(out.read_text())
    assert res["prompts"] == 2 and res["outputs_identical"] and res["family"] == "qwen2_audio_single_placeholder"
    assert res["spec_tokens"] == res["greedy_tokens"] > 0


def _conversations_used(monkeypatch) -> list:
    """The `ConversationConfig` of each manifest `dflash-eval` renders (spied on its collator factory)."""
    used = []
    real = eval_rows.speech_rows_and_collator

    def spy(*args, **kw):
        used.append(kw["conversation"])
        return real(*args, **kw)

    monkeypatch.setattr(eval_rows, "speech_rows_and_collator", spy)
    return used


@pytest.mark.slow
def test_eval_renders_manifests_with_the_conversation_the_draft_was_trained_with(tmp_path, monkeypatch, caplog):
    """dflash-train records its user prompt, system prompt, cut fields and family row in the export; dflash-eval
    renders the manifest's prompts with them when its flags are left out, warns when a given flag differs (and uses
    the flag), and warns when a draft records none."""
    from utils import make_args

    from dflash_hf import DFlashTrainer
    from dflash_hf.targets.processor import load_processor
    from dflash_hf.training.training_args import DFlashDataArguments

    target = tiny.save_tiny_target(
        tmp_path / "asr", kind="qwen3_asr", hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1
    )
    manifest = tiny.synthesize_speech(tmp_path / "speech", num_utterances=2, max_dur=0.8)
    mask_id = tiny.build_tokenizer().convert_tokens_to_ids(tiny.MASK_TOKEN)
    trainer = DFlashTrainer(
        args=make_args(tmp_path / "run", mask_token_id=mask_id, max_steps=1, num_draft_layers=1),
        target=load_target(str(target)),
        processor=load_processor(str(target)),
        data_args=DFlashDataArguments(max_tokens=600, prompt="Transcribe.", system_prompt="Be brief."),
        train_dataset=[str(manifest)],
    )
    trainer.train()
    export = trainer.export_draft(str(tmp_path / "draft"))
    recorded = json.loads((tmp_path / "draft" / "dflash_training.json").read_text())["conversation"]
    assert "conversation" not in json.loads((tmp_path / "draft" / "config.json").read_text())["dflash_config"]
    assert recorded == {
        "prompt": "Transcribe.",
        "system_prompt": "Be brief.",
        "context_key": "context",
        "system_prompt_key": "system_prompt",
        "family": "qwen3_asr",
    }
    used = _conversations_used(monkeypatch)
    out = tmp_path / "res.json"
    argv = ["--draft", export, "--target", str(target), "--data", str(manifest), "--max_new_tokens", "4"]
    argv += ["--output_json", str(out), "--overwrite_output_json", "true"]
    caplog.set_level("WARNING", logger="dflash_hf")

    def warnings() -> str:  # dflash-eval's own (its package's modules log under their own names)
        return " ".join(r.getMessage() for r in caplog.records if r.name == "dflash_hf")

    assert cli_eval.main(argv) == 0
    assert (used[-1].prompt, used[-1].system_prompt) == ("Transcribe.", "Be brief.") and not warnings()
    res = json.loads(out.read_text())
    assert (res["prompt"], res["system_prompt"], res["family"]) == ("Transcribe.", "Be brief.", "qwen3_asr")
    assert res["conversation_recorded"] == recorded
    assert cli_eval.main(argv + ["--prompt", "Transcribe."]) == 0 and not warnings()  # the same: no warning
    assert cli_eval.main(argv + ["--prompt", "Write it down.", "--system_prompt", ""]) == 0  # explicit overrides
    assert (used[-1].prompt, used[-1].system_prompt) == ("Write it down.", "")
    warned = warnings()
    assert "--prompt 'Write it down.' differs from the user prompt the draft was trained with ('Transcribe.'" in warned
    assert "--system_prompt '' differs from the system prompt" in warned
    caplog.clear()
    old = _save_draft(target, tmp_path / "old_draft")  # an export without the record
    assert cli_eval.main(["--draft", str(old), *argv[2:]]) == 0
    assert used[-1].prompt is None and "records no conversation settings" in warnings()
    # an export written before the training record kept the conversation in config.json's dflash_config
    config = json.loads((old / "config.json").read_text())
    config["dflash_config"]["conversation"] = recorded
    (old / "config.json").write_text(json.dumps(config))
    assert cli_eval.main(["--draft", str(old), *argv[2:]]) == 0
    assert (used[-1].prompt, used[-1].system_prompt) == ("Transcribe.", "Be brief.")


def test_a_malformed_conversation_record_is_named(tmp_path):
    from dflash_hf.export.training_record import checked_conversation

    assert checked_conversation(None) is None
    with pytest.raises(ValueError, match="malformed conversation"):
        checked_conversation({"prompt": "x"})
    bad = dict.fromkeys(("prompt", "system_prompt", "context_key", "system_prompt_key", "family"), None) | {"prompt": 3}
    with pytest.raises(ValueError, match=r"fields \['prompt'\] must be strings or null"):
        checked_conversation(bad)


def test_tree_budgets_are_evaluated_beside_the_chain(text_setup, capsys):
    """`--tree_budget 3 8`: the prompts also decode with trees of 3 (block_size - 1: the chain) and 8 nodes, a pass
    each, compared with the chain pass's greedy decodes; their figures sit under `tree` in the JSON and in the table."""
    root, target, draft, prompts = text_setup
    out_json = root / "tree.json"
    argv = ["--draft", str(draft), "--target", str(target), "--data", str(prompts), "--max_new_tokens", "10"]
    assert cli_eval.main([*argv, "--output_json", str(out_json), "--tree_budget", "3", "8"]) == 0
    res = json.loads(out_json.read_text())
    assert res["tree_budget"] == [3, 8] and sorted(res["tree"]) == ["3", "8"]
    for budget, tree in res["tree"].items():
        assert tree["prompts"] == 3 and tree["outputs_identical"] and tree["greedy_tokens"] == res["greedy_tokens"]
        assert tree["spec_tokens"] == res["spec_tokens"] and tree["target_forwards"] >= 3, budget
    chain = res["tree"]["3"]  # a tree of block_size - 1 nodes is the chain
    assert (chain["cycles"], chain["tau"], chain["target_forwards"]) == (
        res["cycles"],
        res["tau"],
        res["target_forwards"],
    )
    table = capsys.readouterr().out
    assert "tree    3: tau" in table and "tree    8: tau" in table and "outputs identical: NO" not in table
    with pytest.raises(ValueError, match="--tree_budget takes distinct node budgets >= 1"):
        cli_eval.main([*argv, "--tree_budget", "0"])


def test_a_long_reference_answer_is_no_bad_row_for_evaluation_prompts(tmp_path):
    """The response text of an evaluation row is dropped (the prompt is what comes before it), so training's
    characters-per-second check does not refuse a long answer: `--data` and a plain path to the benchmarks' reader."""
    model, processor = tiny.build_qwen3_asr_target(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    manifest = tiny.synthesize_speech(tmp_path / "speech", num_utterances=2, max_dur=0.8)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    rows[1]["text"] = "A long answer that describes the audio clip in several sentences. " * 3  # > 50 chars/s
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversation = eval_rows.recorded_conversation(None, prompt="Describe.")
    prompts = eval_rows.evaluation_prompts(str(manifest), processor, model.config, conversation=conversation)
    assert len(list(prompts)) == 2
    cuts, _ = eval_rows.speech_rows_and_collator(str(manifest), processor, model.config)
    assert [c.supervisions[0].text for c in cuts][1] == rows[1]["text"]


def test_a_target_that_cannot_take_tree_verification_is_refused_before_any_decoding(text_setup, monkeypatch):
    """`--tree_budget` on a target with sliding-window layers: refused before the chain pass (dflash-eval checks it
    after loading the target; `decode_benchmark` before it reads a prompt)."""
    root, target, draft, prompts = text_setup
    real_load = evaluation_setup.load_target

    def sliding_window_target(*args, **kwargs):
        model = real_load(*args, **kwargs)
        model.config.use_sliding_window, model.config.sliding_window = True, 4
        return model

    def decoded(*args, **kwargs):
        raise AssertionError("decoded before the refusal")

    monkeypatch.setattr(evaluation_setup, "load_target", sliding_window_target)
    monkeypatch.setattr(cli_eval, "decode_benchmark", decoded)
    argv = ["--draft", str(draft), "--target", str(target), "--data", str(prompts), "--tree_budget", "8"]
    with pytest.raises(ValueError, match="tree_budget: .*sliding-window"):
        cli_eval.main([*argv, "--output_json", str(root / "refused.json")])

    model = sliding_window_target(str(target))
    read = []

    def inputs():
        read.append(1)
        yield {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}

    draft_model = evaluation_setup.load_draft_strict(str(draft))
    with pytest.raises(ValueError, match="tree_budget: .*sliding-window"):
        evaluation.decode_benchmark(draft_model, model, inputs(), 4, tree_budgets=[8])
    with pytest.raises(ValueError, match="tree_budget must be >= 1"):
        evaluation.decode_benchmark(draft_model, real_load(str(target)), inputs(), 4, tree_budgets=[0])
    assert read == []  # no prompt was read, let alone decoded


def test_the_tree_passes_hold_no_device_inputs_of_the_chain_pass(text_setup, monkeypatch):
    """The tree passes re-read each prompt from a host copy: the target-device inputs of the chain pass are freed as it
    goes (the device holds one prompt's at a time, however many prompts are evaluated)."""
    import weakref

    root, target, draft, _ = text_setup

    class Inputs(dict):  # a dict that can be weakly referenced
        pass

    real_inputs, real_generate = evaluation.generate_inputs, evaluation.speculative_generate
    made, alive_in_trees = [], []

    def generate_inputs(ft, prompt):
        inputs = Inputs(real_inputs(ft, prompt))
        made.append(weakref.ref(inputs))
        return inputs

    def speculative_generate(*args, options, **kwargs):
        if options.tree_budget is not None:
            alive_in_trees.append(sum(ref() is not None for ref in made[:3]))  # the chain pass's three prompts
        return real_generate(*args, options=options, **kwargs)

    monkeypatch.setattr(evaluation, "generate_inputs", generate_inputs)
    monkeypatch.setattr(evaluation, "speculative_generate", speculative_generate)
    ones = torch.ones(1, 3, dtype=torch.long)
    prompts = [{"input_ids": torch.tensor([[5 + i, 6, 7]]), "attention_mask": ones} for i in range(3)]
    model, draft_model = load_target(str(target)), evaluation_setup.load_draft_strict(str(draft))
    stats = evaluation.decode_benchmark(draft_model, model, prompts, 4, tree_budgets=[8])
    assert stats.trees[8].prompts == 3 and not stats.trees[8].mismatches
    assert alive_in_trees and set(alive_in_trees) == {0}
