"""benchmarks/decode_profile.py on the tiny target, and the host reads of the speculative decode loop."""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import StoppingCriteria
from utils import REPO_ROOT, script_fixture

from dflash_hf.generation import speculative
from dflash_hf.testing import tiny

SCRIPT = REPO_ROOT / "benchmarks" / "decode_profile.py"


profile = script_fixture(SCRIPT)


@pytest.mark.parametrize("kind", ["text", "whisper"])
def test_tiny_breakdown_adds_up_and_outputs_are_identical(profile, tmp_path, kind):
    out = tmp_path / "profile.json"
    results = profile.main(
        [
            "--tiny",
            kind,
            "--num_prompts",
            "2",
            "--max_new_tokens",
            "10",
            "--progress",
            "false",
            "--output_json",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert results["outputs_identical"] and results["instrumented_outputs_identical"]
    wall, prof = results["wall_clock"], results["instrumented"]
    assert wall["outputs_identical"] and wall["prompts"] == 2
    assert prof["tokens"] == wall["spec_tokens"] and prof["cycles"] == wall["cycles"] > 0
    seconds = prof["seconds"]
    assert set(seconds) == {"setup", "prefill", "draft", "proposal", "verify", "host"}
    assert sum(seconds.values()) == pytest.approx(prof["total_s"], rel=1e-6)
    assert all(seconds[name] > 0 for name in ("prefill", "draft", "proposal", "verify"))
    assert seconds["host"] >= 0 and seconds["setup"] >= 0  # the measured phases lie inside the call
    parts = prof["host_parts_seconds"]
    assert sum(parts.values()) == pytest.approx(seconds["host"], rel=1e-6, abs=1e-9)
    assert all(parts[name] > 0 for name in ("scores", "accept", "stop", "crop"))
    assert sum(prof["fraction"].values()) == pytest.approx(1.0)
    assert results["command"].endswith(
        f"decode_profile.py --tiny {kind} --num_prompts 2 --max_new_tokens 10 --progress false --output_json {out}"
    )
    assert results["commit"] and results["device"].startswith("cpu")
    # the package's functions are restored after the instrumented pass
    assert speculative.TargetVerifier.__call__.__qualname__ == "TargetVerifier.__call__"
    from dflash_hf.generation import verify_rules

    assert (
        speculative.propose_block is verify_rules.propose_block
        and speculative.accept_prefix is verify_rules.accept_prefix
    )


def test_the_fixed_shape_verify_is_timed_as_verify(profile, tmp_path):
    """--verify_cuda_graph on (the fixed-shape verify; on the CPU without a graph): its forwards count as `verify`,
    not as host work, and the outputs stay identical."""
    results = profile.main(
        [
            "--tiny",
            "text",
            "--num_prompts",
            "2",
            "--max_new_tokens",
            "10",
            "--progress",
            "false",
            "--verify_cuda_graph",
            "on",
            "--output_json",
            str(tmp_path / "p.json"),
        ]
    )
    assert results["outputs_identical"] and results["instrumented_outputs_identical"]
    seconds = results["instrumented"]["seconds"]
    assert seconds["verify"] > 0  # without its wrapper the fixed-shape verify would count as host work (0 here)
    assert results["wall_clock"]["verify_steps"] == {"fixed-shape, no graph": 2}
    from dflash_hf.generation import fixed_verify

    assert fixed_verify.FixedVerifyStep.verify.__qualname__ == "FixedVerifyStep.verify"  # restored


def test_a_saved_model_side_target_is_profiled_on_its_own_row(profile, tmp_path):
    """--family picks the model-side single-placeholder row (and --prompt its user text): both passes decode on that
    row's path, identical to its greedy baseline."""
    from test_families import save_qwen2_audio

    from dflash_hf import DFlashConfig, DFlashDraftModel
    from dflash_hf.targets.frozen import FrozenTarget

    model, tok = save_qwen2_audio(tmp_path / "target")
    cfg = DFlashConfig.from_target_config(
        FrozenTarget(model).text_config,
        num_hidden_layers=1,
        block_size=4,
        mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN),
    )
    DFlashDraftModel(cfg).save_pretrained(tmp_path / "draft")
    manifest = tiny.synthesize_speech(tmp_path / "speech", num_utterances=2, max_dur=0.8)
    results = profile.main(
        [
            "--target",
            str(tmp_path / "target"),
            "--draft",
            str(tmp_path / "draft"),
            "--data",
            str(manifest),
            "--family",
            "qwen2_audio_single_placeholder",
            "--prompt",
            "Transcribe.",
            "--num_prompts",
            "2",
            "--max_new_tokens",
            "6",
            "--progress",
            "false",
            "--output_json",
            str(tmp_path / "p.json"),
        ]
    )
    assert results["outputs_identical"] and results["instrumented_outputs_identical"]
    assert results["wall_clock"]["prompts"] == 2 and results["instrumented"]["cycles"] > 0
    assert results["family"] == "qwen2_audio_single_placeholder"


def test_bad_arguments_are_named(profile):
    with pytest.raises(ValueError, match="--tiny must be one of"):
        profile.main(["--tiny", "qwen"])
    with pytest.raises(ValueError, match="drop --target"):
        profile.main(["--tiny", "text", "--target", "x"])
    with pytest.raises(ValueError, match="give --data, --draft, --target"):
        profile.main([])
    with pytest.raises(ValueError, match="--num_prompts must be >= 1"):
        profile.main(["--tiny", "text", "--num_prompts", "0"])


def test_greedy_decode_reads_the_device_once_per_cycle(monkeypatch):
    """Inside the decode loop, only the prompt's first token and each cycle's acceptance are read back to the host
    (a device-to-host read synchronizes the GPU): no per-token `int`/`bool`/`.tolist()` of device values."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import StoppingCriteriaList
    from utils import tiny_text_target

    from dflash_hf import DFlashConfig, DFlashDraftModel
    from dflash_hf.generation import verify_rules
    from dflash_hf.generation.speculative import dflash_custom_generate
    from dflash_hf.targets.frozen import FrozenTarget
    from dflash_hf.testing import tiny

    reads, decoding = [], []
    torch_dir = str(Path(torch.__file__).parent)

    def record_if_from_speculative(kind: str) -> None:
        frame = sys._getframe(2)
        while frame.f_code.co_filename.startswith(torch_dir):  # torch's own wrappers in between
            frame = frame.f_back
        if frame.f_code.co_filename in (speculative.__file__, verify_rules.__file__):  # the loop and its rules
            reads.append((kind, frame.f_lineno))

    class ScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:  # int(), bool(), .item() of a tensor
                record_if_from_speculative("scalar")
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        if decoding:
            record_if_from_speculative("tolist")
        return tolist(self)

    decode = speculative.decode_loop

    def decode_counted(*args, **kwargs):
        decoding.append(True)
        try:
            with ScalarReads():
                return decode(*args, **kwargs)
        finally:
            decoding.clear()

    model, tok = tiny_text_target(seed=1)
    tiny.sharpen(model, seed=1)
    cfg = DFlashConfig.from_target_config(
        FrozenTarget(model).text_config,
        num_hidden_layers=1,
        block_size=4,
        mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN),
    )
    torch.manual_seed(0)
    draft = DFlashDraftModel(cfg).eval()
    prompt = torch.randint(3, 250, (1, 7), generator=torch.Generator().manual_seed(0))
    kw = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt))
    ref = model.generate(**kw, max_new_tokens=12, do_sample=False)
    monkeypatch.setattr(speculative, "decode_loop", decode_counted)
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    out = speculative.speculative_generate(draft, model, 12, **kw)
    assert torch.equal(out.sequences, ref)
    cycles = len(out.acceptance_lengths)
    assert cycles > 2
    assert len(reads) == 1 + cycles, reads  # the prompt's first token, then one read per cycle
    # a user's stopping criterion: evaluated for every new token, read back once per check
    reads.clear()
    criteria = StoppingCriteriaList([NeverStop()])
    custom = dflash_custom_generate(draft)
    assert torch.equal(
        model.generate(**kw, max_new_tokens=12, do_sample=False, stopping_criteria=criteria, custom_generate=custom),
        ref,
    )
    cycles = len(custom.acceptance_lengths)
    assert len(reads) == 2 + 2 * cycles, reads  # prompt: token + its check; each cycle: acceptance + its check


class NeverStop(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] < 0


def test_begin_suppression_applies_to_the_row_at_its_begin_index_only():
    """`processed_scores` runs Whisper's begin-suppression on the one block row whose prefix is `begin_index` ids long,
    and gives what running it on every row (as `generate` does token by token) gives."""
    from transformers import LogitsProcessorList, SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor

    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    prefix = torch.arange(12)[None]  # row i follows prefix[:, :9 + i]
    for begin_index in (8, 9, 10, 12, 13):
        processors = LogitsProcessorList(
            [SuppressTokensLogitsProcessor([3]), SuppressTokensAtBeginLogitsProcessor([5, 6], begin_index)]
        )
        expected = torch.cat([processors(prefix[:, : 9 + i], logits[i : i + 1]) for i in range(4)])
        got = speculative.processed_scores(processors, prefix, logits)
        assert torch.equal(got, expected), begin_index
        assert bool(got[:, 3].isinf().all())
        row = begin_index - 9
        assert bool(got[:, 5].isinf().any()) == (0 <= row < 4)
