"""`benchmarks/vllm_parity.py`: its arguments and requests are checked before any engine starts, the target alone is
checked against transformers' greedy `generate` first (and stops the run when it differs beyond a near tie), each vLLM
run is configured as the export says (`num_speculative_tokens` = block size - 1), the dflash_hf side decodes the same
requests, and the comparison counts what it claims; the results record the versions and the class vLLM served. The
vLLM runs themselves need vLLM and a GPU (not here: they are replaced by recorded results)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.errors import DFlashUserError
from dflash_hf.export.drafts import export_draft
from dflash_hf.testing import tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serving_checks  # noqa: E402
import vllm_parity  # noqa: E402
from vllm_parity_parts import arguments, comparison, engine, reference, request_rows  # noqa: E402

SERVED_BY = {"architecture": "Qwen3ForCausalLM", "class": "vllm.model_executor.models.qwen3.Qwen3ForCausalLM"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny text target directory, a random DFlash export of block 4 for it, and three requests."""
    root = tmp_path_factory.mktemp("parity")
    target = tiny.save_tiny_target(root / "target", kind="text", hidden_size=32, num_layers=4, num_heads=2)
    model = tiny.build_text_target(hidden_size=32, num_layers=4, num_heads=2)
    tok = tiny.build_tokenizer()
    config = DFlashConfig.from_target_config(
        model.config, mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN), num_hidden_layers=1, block_size=4
    )
    torch.manual_seed(0)
    draft = export_draft(DFlashDraftModel(config), root / "draft")
    prompts = root / "prompts.jsonl"
    rows = [{"prompt": "yes no up"}, {"messages": [{"role": "user", "content": "left right"}]}, {"text": "on off"}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return target, draft, prompts


def _argv(setup, *extra: str) -> list[str]:
    target, draft, prompts = setup
    return ["--target", str(target), "--draft", str(draft), "--prompts", str(prompts), *extra]


def test_versions_say_when_dflash_hf_runs_uninstalled(monkeypatch):
    import dflash_hf

    real = serving_checks.version
    monkeypatch.setattr(
        serving_checks, "version", lambda name: real(name) if name != "dflash_hf" else real("no-such-dist-x")
    )
    assert serving_checks.versions()["dflash_hf"] == f"{dflash_hf.__version__} (not installed)"
    monkeypatch.setattr(serving_checks, "version", lambda name: "9.9" if name == "dflash_hf" else real(name))
    assert serving_checks.versions()["dflash_hf"] == "9.9"


def test_help_needs_no_vllm(capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:  # imported by earlier tests
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(SystemExit) as exit_info:
        vllm_parity.main(["--help"])
    assert exit_info.value.code == 0
    assert "vllm" not in sys.modules
    text = capsys.readouterr().out
    assert "--concurrency" in text and "--max_new_tokens" in text and "--target" in text


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--precision", "fp16"], "--precision must be one of"),
        (["--concurrency", "1", "0"], "--concurrency takes positive"),
        (["--max_new_tokens", "0"], "--max_new_tokens must be >= 1"),
        (["--num_prompts", "-1"], "--num_prompts must be >= 0"),
        (["--gpu_memory_utilization", "1.5"], "--gpu_memory_utilization must be in"),
        (["--tie_margin", "-1"], "--tie_margin must be >= 0"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(setup, extra, match):
    with pytest.raises(DFlashUserError, match=match):
        vllm_parity.main(_argv(setup, *extra))


def test_a_draft_that_is_not_an_export_is_refused(setup, tmp_path):
    target, _, prompts = setup
    with pytest.raises(DFlashUserError, match="has no config.json"):
        vllm_parity.main(["--target", str(target), "--draft", str(tmp_path), "--prompts", str(prompts)])


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("not json", r"prompts.jsonl:2 is not JSON"),
        ('["a"]', r"prompts.jsonl:2 holds a JSON list"),
        ('{"prompt": "a", "text": "b"}', r"needs exactly one of \['messages', 'prompt', 'text'\]"),
        ('{"messages": []}', "non-empty list of chat messages"),
        ('{"prompt": "a", "audio": "missing.wav"}', "audio file missing.wav does not exist"),
    ],
)
def test_bad_request_rows_name_their_line(tmp_path, line, match):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DFlashUserError, match=match):
        request_rows.read_requests(path)


def test_requests_render_as_the_chat_template_does(setup):
    tok = tiny.build_tokenizer()
    rows = request_rows.read_requests(setup[2])
    assert len(request_rows.read_requests(setup[2], limit=2)) == 2
    expected = tok.apply_chat_template([{"role": "user", "content": "yes no up"}], add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert request_rows.render(rows[0], tok) == list(expected)
    assert request_rows.render(rows[2], tok) == tok("on off", add_special_tokens=False)["input_ids"]
    assert request_rows.vllm_prompts(rows, str(setup[0]))[0] == {"prompt_token_ids": list(expected)}


def _recorded(requests: list[dict], seconds: float, drafts: int = 0, accepted: int = 0) -> dict:
    tokens = sum(len(r["token_ids"]) for r in requests)
    counters = {"drafts": drafts, "draft_tokens": 3 * drafts, "accepted_tokens": accepted}
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "requests": requests,
        "spec_counters": counters,
        "serving_class": SERVED_BY,
    }


def _worker(configs: list, result_for):
    """A stand-in for `engine.launch`: per pass of the engine's config, the result a worker would write
    (`result_for(config, one_pass)`), the config kept in `configs`; exit 0."""

    def launch(cmd):
        config = json.loads(Path(cmd[cmd.index("--worker") + 1]).read_text())
        configs.append(config)
        for one_pass in config["passes"]:
            result = result_for(config, one_pass)
            result["engine"] = {
                "max_num_seqs": config["max_num_seqs"],
                "one_request_at_a_time": one_pass["one_at_a_time"],
            }
            Path(one_pass["result"]).write_text(json.dumps(result))
        return 0

    return launch


def _launched(configs: list) -> list:
    """Each engine launched: with the draft or not, its max_num_seqs, and its passes (concurrency, top
    log-probabilities, one request at a time)."""
    return [
        (
            c["draft"] is not None,
            c["max_num_seqs"],
            [(p["concurrency"], p["logprobs"], p["one_at_a_time"]) for p in c["passes"]],
        )
        for c in configs
    ]


def test_engine_pairs_serve_1_and_the_largest_concurrency_on_one_engine(setup):
    assert engine.engine_pairs([1, 8]) == {8: [1, 8]}
    assert engine.engine_pairs([8, 1]) == {8: [8, 1]}
    assert engine.engine_pairs([1]) == {1: [1]}
    argv = _argv(setup, "--concurrency", "4", "1", "8", "2", "4")
    (args,) = arguments.make_parser().parse_args_into_dataclasses(argv)
    assert args.concurrency == [4, 1, 8, 2]  # each once, in the order given
    assert engine.engine_pairs(args.concurrency) == {4: [4], 8: [1, 8], 2: [2]}  # the first concurrency's pair first


@pytest.mark.slow  # decodes three requests with the tiny target on the CPU
def test_run_configures_each_vllm_engine_and_compares_with_dflash_hf(setup, tmp_path, monkeypatch):
    ours = reference.run_dflash_hf(arguments.make_parser().parse_args_into_dataclasses(_argv(setup))[0])
    assert len(ours) == 3 and all(1 <= n <= 4 for r in ours for n in r["acceptance_lengths"])
    configs = []

    def recorded(config, one_pass):  # what the worker would write, from the dflash_hf decode
        if one_pass["logprobs"]:  # the target check: vLLM alone writes transformers' greedy output (lossless decode)
            requests = [{"token_ids": r["token_ids"], "top_logprobs": None, "acceptance_lengths": None} for r in ours]
            return _recorded(requests, 1.0)
        requests = [
            {"token_ids": r["token_ids"], "acceptance_lengths": r["acceptance_lengths"] if config["draft"] else None}
            for r in ours
        ]
        if config["draft"]:  # one request decodes differently with the draft, one cycle accepts differently
            requests[1] = {"token_ids": [*requests[1]["token_ids"], 7], "acceptance_lengths": [1]}
        cycles = sum(len(r["acceptance_lengths"] or []) for r in requests)
        accepted = sum(n - 1 for r in requests for n in r["acceptance_lengths"] or [])
        seconds = (1.0 if config["draft"] else 2.0) * (1 if one_pass["one_at_a_time"] else 0.5)
        return _recorded(requests, seconds, cycles, accepted)

    monkeypatch.setattr(engine, "launch", _worker(configs, recorded))
    out = tmp_path / "parity.json"
    results = vllm_parity.main(_argv(setup, "--concurrency", "1", "8", "--out", str(out), "--precision", "fp32"))
    assert json.loads(out.read_text())["parity"] == results["parity"]
    assert _launched(configs) == [  # two engines of max_num_seqs 8: concurrency 1 one request at a time
        (False, 8, [(1, serving_checks.TOP_LOGPROBS, True), (1, 0, True), (8, 0, False)]),  # target check first
        (True, 8, [(1, 0, True), (8, 0, False)]),
    ]
    check = results["target_check"]
    assert check["passed"] and check["identical"] == check["requests"] == 3 and check["tie_margin"] == 1e-3
    assert set(results["versions"]) == {"vllm", "torch", "transformers", "dflash_hf"}
    assert results["serving_class"] == SERVED_BY and "stopped" not in results
    drafted = [c for c in configs if c["draft"]]
    assert all(c["num_speculative_tokens"] == 3 and c["draft"] == str(setup[1]) for c in drafted)
    assert all(c["dtype"] == "float32" and c["enforce_eager"] for c in configs)
    parity = results["parity"]
    assert parity["requests"] == 3 and parity["mismatched_requests"] == [1]
    assert parity["outputs_equal_to_vllm_greedy"] == 2 and parity["dflash_hf_outputs_equal_to_vllm_greedy"] == 3
    assert parity["identical_acceptance_sequences"] == 2
    lengths = [n for i, r in enumerate(ours) for n in r["acceptance_lengths"] if i != 1] + [1]
    assert parity["tau_vllm"] == pytest.approx(sum(lengths) / len(lengths)) == parity["tau_vllm_counters"]
    assert [row["speedup"] for row in results["throughput"]] == pytest.approx([2.0, 2.0], rel=0.1)
    tokens = sum(len(r["token_ids"]) for r in ours)
    assert [row["tokens_per_s_target_alone"] for row in results["throughput"]] == pytest.approx([tokens / 2, tokens])
    runs = results["runs"]
    assert set(runs) == {"1", "8"} and all(set(r) == {"target_alone", "with_draft"} for r in runs.values())
    assert runs["1"]["with_draft"]["engine"] == {"max_num_seqs": 8, "one_request_at_a_time": True}
    assert runs["8"]["target_alone"]["engine"] == {"max_num_seqs": 8, "one_request_at_a_time": False}
    assert check["engine"] == {"max_num_seqs": 8, "one_request_at_a_time": True}
    assert results["num_speculative_tokens"] == 3 and results["architecture"] == "DFlashDraftModel"


def test_comparison_strips_one_final_end_token():
    alone = _recorded([{"token_ids": [5, 6, 2], "acceptance_lengths": None}], 1.0)
    drafted = _recorded([{"token_ids": [5, 6], "acceptance_lengths": [2, 1]}], 1.0, drafts=2, accepted=1)
    parity = comparison.compare(alone, drafted, None, eos={2})
    assert parity["outputs_equal_to_vllm_greedy"] == 1 and parity["tau_vllm"] == 1.5 == parity["tau_vllm_counters"]
    assert comparison.compare(alone, drafted, None, eos=set())["mismatched_requests"] == [0]


def _greedy(tokens: list[int], logits: dict[int, dict[int, float]] | None = None) -> dict:
    return {
        "token_ids": tokens,
        "logits_at": {str(k): {str(t): v for t, v in d.items()} for k, d in (logits or {}).items()},
    }


def test_target_check_tells_a_near_tie_from_another_function():
    vllm_side = [
        {"token_ids": [5, 6, 7, 2], "top_logprobs": None},
        {"token_ids": [5, 9, 7], "top_logprobs": [[[5, -0.1]], [[9, -0.70], [6, -0.71]], [[7, -0.2]]]},
        {"token_ids": [5, 8], "top_logprobs": None},
        {"token_ids": [4], "top_logprobs": None},
    ]
    hf_side = [
        _greedy([5, 6, 7]),  # the same, one final end token aside
        _greedy([5, 6, 7], {1: {6: 3.0, 9: 2.9995}}),  # vLLM's token within a near tie: numerics
        _greedy([5, 6], {1: {6: 3.0, 8: 1.0}}),  # two logits apart: another function
        _greedy([3], {0: {3: 2.0}}),  # vLLM's token outside transformers' top 8: another function
    ]
    check = serving_checks.compare_target(vllm_side, hf_side, 1e-3, lambda t: t[:-1] if t[-1:] == [2] else t)
    rows = check["per_request"]
    assert [r["identical"] for r in rows] == [True, False, False, False] and check["identical"] == 1
    assert rows[1]["first_divergence"] == 1 and rows[1]["numerics"]
    assert rows[1]["transformers_margin"] == pytest.approx(5e-4) and rows[1]["vllm_margin"] == pytest.approx(0.01)
    assert rows[2]["transformers_margin"] == 2.0 and not rows[2]["numerics"] and "vllm_margin" not in rows[2]
    assert rows[3]["transformers_margin"] is None and not rows[3]["numerics"]
    assert check["divergences_not_numerics"] == [2, 3] and not check["passed"]


def test_target_check_weighs_the_end_token_of_the_side_that_stopped():
    """At a divergence where one side stopped, its token is the end token it chose (2 here), margins as for any token;
    an output cut by `max_new_tokens` (no end token) has no token there and stays unexplained."""
    vllm_side = [
        {"token_ids": [5, 6, 2], "top_logprobs": [[[5, -0.1]], [[6, -0.1]], [[2, -0.69], [0, -0.70]]]},
        {"token_ids": [5, 6, 2], "top_logprobs": None},
        {"token_ids": [5, 7, 2], "top_logprobs": [[[5, -0.1]], [[7, -0.70], [2, -0.71]], [[2, -0.1]]]},
        {"token_ids": [5, 2], "top_logprobs": None},
        {"token_ids": [5, 6, 7, 2], "top_logprobs": None},
        {"token_ids": [5, 6], "top_logprobs": None},
        {"token_ids": [5, 2, 7], "top_logprobs": None},
    ]
    hf_side = [
        _greedy([5, 6, 0, 2], {2: {0: 3.0, 2: 2.9995}}),  # vLLM stopped within a near tie: numerics
        _greedy([5, 6, 0, 2], {2: {0: 3.0, 2: 1.0}}),  # vLLM stopped two logits below: another function
        _greedy([5, 2], {1: {2: 3.0, 7: 2.9995}}),  # transformers stopped within a near tie: numerics
        _greedy([5, 0, 2], {1: {0: 3.0, 9: 2.0}}),  # the end token outside transformers' top 8: unexplained
        _greedy([5, 6], {1: {6: 3.0}}),  # transformers cut by max_new_tokens: no token, unexplained
        _greedy([5, 6, 7, 2], {2: {7: 3.0, 2: 2.9995}}),  # vLLM cut by max_new_tokens: no token, unexplained
        _greedy([5, 2], {1: {2: 3.0, 7: 2.9995}}),  # vLLM went on past the end token: no margin to itself
    ]
    check = serving_checks.compare_target(vllm_side, hf_side, 1e-3, lambda t: t[:-1] if t[-1:] == [2] else t)
    rows = check["per_request"]
    assert [r["first_divergence"] for r in rows] == [2, 2, 1, 1, 2, 2, 1]
    assert [(r["transformers_token"], r["vllm_token"], r.get("ended")) for r in rows] == [
        (0, 2, "vllm"),
        (0, 2, "vllm"),
        (2, 7, "transformers"),
        (0, 2, "vllm"),
        (None, 7, None),
        (7, None, None),
        (2, 2, "transformers"),
    ]
    assert rows[0]["numerics"] and rows[0]["transformers_margin"] == pytest.approx(5e-4)
    assert rows[0]["vllm_margin"] == pytest.approx(0.01)
    assert rows[1]["transformers_margin"] == 2.0 and not rows[1]["numerics"]
    assert rows[2]["numerics"] and rows[2]["transformers_margin"] == pytest.approx(5e-4)
    assert rows[2]["vllm_margin"] == pytest.approx(0.01)
    assert rows[3]["transformers_margin"] is None and not rows[3]["numerics"]
    assert all("transformers_margin" not in r and "vllm_margin" not in r for r in rows[4:])
    assert check["divergences_not_numerics"] == [1, 3, 4, 5, 6] and not check["passed"]


def test_a_target_that_differs_stops_the_run_before_any_draft(setup, tmp_path, monkeypatch):
    configs = []

    def differing_target(config, one_pass):
        requests = [{"token_ids": [7, 7, 7], "top_logprobs": None, "acceptance_lengths": None}] * 3
        return _recorded(requests, 1.0)

    monkeypatch.setattr(engine, "launch", _worker(configs, differing_target))
    out = tmp_path / "parity.json"
    with pytest.raises(SystemExit, match="stopped: the target alone differs from transformers"):
        vllm_parity.main(_argv(setup, "--out", str(out), "--precision", "fp32", "--max_new_tokens", "3"))
    # the target's engine only (its timed passes ran after the check, in the same engine): no draft engine started
    assert _launched(configs) == [(False, 8, [(1, serving_checks.TOP_LOGPROBS, True), (1, 0, True), (8, 0, False)])]
    written = json.loads(out.read_text())
    assert written["target_check"]["divergences_not_numerics"] == [0, 1, 2] and "parity" not in written
    assert set(written["runs"]) == {"1", "8"} and all(set(r) == {"target_alone"} for r in written["runs"].values())


def _greedy_worker(configs: list, greedy: list[dict], crash_with_draft: bool = False):
    """A worker whose target alone writes transformers' greedy output (the draft's engine the same, or it dies)."""
    recorded = _worker(
        configs,
        lambda config, one_pass: _recorded(
            [{"token_ids": g["token_ids"], "top_logprobs": None, "acceptance_lengths": None} for g in greedy], 1.0
        ),
    )

    def launch(cmd):
        config = json.loads(Path(cmd[cmd.index("--worker") + 1]).read_text())
        if crash_with_draft and config["draft"]:
            configs.append(config)
            return 1  # the engine with the draft dies
        return recorded(cmd)

    return launch


def _short_greedy(setup) -> list[dict]:
    args = arguments.make_parser().parse_args_into_dataclasses(_argv(setup, "--max_new_tokens", "3"))[0]
    return reference.reference_greedy(args, comparison.eos_ids(args.target))


def test_a_run_cut_short_leaves_what_it_measured(setup, tmp_path, monkeypatch, capsys):
    configs = []
    monkeypatch.setattr(engine, "launch", _greedy_worker(configs, _short_greedy(setup), crash_with_draft=True))
    out = tmp_path / "parity.json"
    with pytest.raises(RuntimeError, match="failed \\(exit 1\\)"):
        vllm_parity.main(_argv(setup, "--out", str(out), "--precision", "fp32", "--max_new_tokens", "3"))
    assert "target alone: 3/3 outputs identical to transformers' greedy" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["target_check"]["passed"] and "parity" not in written
    assert written["incomplete"] == "the vLLM runs of the target with the draft at concurrency 1, 8"
    assert set(written["runs"]) == {"1", "8"} and all(set(r) == {"target_alone"} for r in written["runs"].values())
    assert written["runs"]["8"]["target_alone"]["engine"] == {"max_num_seqs": 8, "one_request_at_a_time": False}
    assert [(c["draft"] is not None, c["max_num_seqs"]) for c in configs] == [(False, 8), (True, 8)]


def test_a_concurrency_between_1_and_the_largest_gets_its_own_engine_pair(setup, tmp_path, monkeypatch):
    configs = []
    monkeypatch.setattr(engine, "launch", _greedy_worker(configs, _short_greedy(setup)))
    out = tmp_path / "parity.json"
    argv = ["--out", str(out), "--precision", "fp32", "--max_new_tokens", "3", "--skip_dflash_hf", "true"]
    results = vllm_parity.main(_argv(setup, *argv, "--concurrency", "1", "4", "8"))
    assert _launched(configs) == [
        (False, 8, [(1, serving_checks.TOP_LOGPROBS, True), (1, 0, True), (8, 0, False)]),
        (True, 8, [(1, 0, True), (8, 0, False)]),
        (False, 4, [(4, 0, False)]),  # 4 in flight cannot be had from an engine of 8: an engine pair of 4
        (True, 4, [(4, 0, False)]),
    ]
    assert [row["concurrency"] for row in results["throughput"]] == [1, 4, 8]
    assert results["runs"]["4"]["with_draft"]["engine"] == {"max_num_seqs": 4, "one_request_at_a_time": False}
    assert results["target_check"]["passed"] and results["parity"]["outputs_equal_to_vllm_greedy"] == 3


def _literal_values(annotation) -> set:
    """Every value of a (nested) `Literal` annotation."""
    import typing

    args = typing.get_args(annotation)
    return {v for a in args for v in (_literal_values(a) if typing.get_args(a) else [a])}


def test_the_worker_calls_only_what_the_installed_vllm_has():
    """The worker's engine arguments, calls and reads against the vLLM installed (the CI serving stage's 0.34)."""
    import dataclasses
    import inspect

    from utils import require_vllm

    require_vllm()
    from vllm import LLM, SamplingParams
    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.llm_engine import LLMEngine

    config = dict(
        target="t", dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.5, max_model_len=512,
        max_num_seqs=8, draft="d", num_speculative_tokens=7,
    )  # fmt: skip
    engine_kwargs = engine.engine_arguments(config)
    assert set(engine_kwargs) <= {f.name for f in dataclasses.fields(EngineArgs)}
    assert "dflash" in _literal_values(SpeculativeConfig.__dataclass_fields__["method"].type)
    assert set(engine_kwargs["speculative_config"]) <= {f.name for f in dataclasses.fields(SpeculativeConfig)}
    assert set(engine.engine_arguments(config | {"draft": None})) < set(engine_kwargs)
    for name in ("generate", "get_metrics", "reset_prefix_cache", "reset_mm_cache"):
        assert callable(getattr(LLM, name)), name
    assert inspect.signature(LLM.reset_prefix_cache).return_annotation in (bool, "bool")
    assert callable(LLMEngine.reset_encoder_cache)
    top = serving_checks.TOP_LOGPROBS
    assert SamplingParams(temperature=0.0, max_tokens=3, logprobs=top).logprobs == top
    assert {"token_ids", "logprobs", "spec_decode_metrics"} <= {f.name for f in dataclasses.fields(CompletionOutput)}
