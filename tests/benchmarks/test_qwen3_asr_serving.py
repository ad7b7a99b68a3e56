"""benchmarks/qwen3_asr_serving.py at its tiny shape, on the CPU: the target it builds carries vLLM's serving fields
and loads with dflash_hf; dflash-train trains a draft on it; its speech prompts are the training conversation and read
as `vllm_parity.py` requests."""

from __future__ import annotations

import json
import sys

import pytest
from utils import REPO_ROOT, script_fixture

from dflash_hf.targets.frozen import load_target

qs = script_fixture(REPO_ROOT / "benchmarks" / "qwen3_asr_serving.py")


@pytest.fixture(scope="module")
def built(qs, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-asr")
    qs.main(["build", "--out", str(out), "--shape", "tiny", "--train_utterances", "6", "--dev_utterances", "3"])
    return out


def test_the_1_7b_shape_is_qwen3_asr_1_7b(qs):
    audio, text = qs.SHAPES["1.7b"]["audio"], qs.SHAPES["1.7b"]["text"]
    assert (
        (audio["d_model"], audio["encoder_layers"], audio["output_dim"])
        == (1024, 24, text["hidden_size"])
        == (
            1024,
            24,
            2048,
        )
    )
    assert (text["num_hidden_layers"], text["num_attention_heads"], text["num_key_value_heads"]) == (28, 16, 8)
    assert (text["head_dim"], text["vocab_size"], audio["n_window"]) == (128, 151936, 50)


def test_build_writes_a_target_that_serves_and_loads(built):
    raw = json.loads((built / "target" / "config.json").read_text())
    assert raw["audio_config"]["conv_chunksize"] == 500
    assert raw["audio_config"]["max_source_positions"] == raw["audio_config"]["max_position_embeddings"]
    assert raw["text_config"]["head_dim"] == 64
    model = load_target(str(built / "target"))
    assert type(model).__name__ == "Qwen3ASRForConditionalGeneration"
    assert json.loads((built / "built.json").read_text())["shape"] == "tiny"


def test_prompts_are_the_training_conversation_and_read_as_requests(qs, built):
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from vllm_parity_parts.request_rows import load_processor, read_requests, render

    path = qs.prompts(built, 2)
    rows = read_requests(path)
    assert len(rows) == 2 and all(r["audio"].endswith(".wav") for r in rows)
    user = rows[0]["messages"][0]
    assert user["role"] == "user" and user["content"] == [{"type": "text", "text": qs.INSTRUCTION}, {"type": "audio"}]
    processor, tokenizer = load_processor(str(built / "target"))
    text = render(rows[0], tokenizer, processor)
    assert text.endswith("<|im_start|>assistant\n") and "Transcribe the audio.<|audio_start|><|audio_pad|>" in text
    # where processor and tokenizer differ, the processor's template renders audio requests
    processor.chat_template = tokenizer.chat_template.replace("<|audio_pad|>", "<|audio_pad|> ")
    assert "<|audio_pad|> <|audio_end|>" in render(rows[0], tokenizer, processor)


@pytest.mark.slow  # dflash-train on the CPU, two steps, then decoding
def test_train_exports_a_draft_that_vllm_parity_decodes_on_the_speech_prompts(qs, built):
    qs.main(["train", "--out", str(built), "--steps", "2", "--precision", "fp32"])
    config = json.loads((built / "draft" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    assert config["dflash_config"]["mask_token_id"] == 262
    # the reference side of vllm_parity.py on these prompts: transformers' greedy and dflash_hf's decode agree
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import serving_checks
    from vllm_parity_parts.arguments import make_parser
    from vllm_parity_parts.comparison import eos_ids
    from vllm_parity_parts.reference import load_reference, run_dflash_hf

    qs.main(["prompts", "--out", str(built), "--num_prompts", "2"])
    argv = ["--target", str(built / "target"), "--draft", str(built / "draft")]
    argv += ["--prompts", str(built / "speech.jsonl"), "--precision", "fp32", "--max_new_tokens", "6"]
    (args,) = make_parser().parse_args_into_dataclasses(argv)
    reference = load_reference(args)
    greedy = serving_checks.transformers_greedy(reference[0].model, reference[1], 6, eos_ids(args.target))
    ours = run_dflash_hf(args, reference)
    assert len(greedy) == 2 and [g["token_ids"] for g in greedy] == [o["token_ids"] for o in ours]
    assert all(len(g["logits_at"]) == len(g["token_ids"]) for g in greedy)
