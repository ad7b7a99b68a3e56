"""DFlash2 (docs/ARCHITECTURE.md): identity init, block-local convolutions, selector CE, trainer integration,
checkpoint contract + remote code, conversion, lossless greedy and sampled speculative decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM
from utils import REPO_ROOT, assert_lossless_greedy, chi_square_p_value, make_trainer, text_batch, tiny_text_target

from dflash_hf import DFlash2DraftModel, DFlashConfig, DFlashDraftModel, DFlashTrainingArguments
from dflash_hf.export import load_draft_strict
from dflash_hf.generation.verify_rules import accept_tokens
from dflash_hf.objective.blocks import attention_mask_for, build_blocks, doc_ids_from, row_positions
from dflash_hf.objective.losses import MetricSums, block_loss, dflash2_block_loss
from dflash_hf.testing import tiny

DFLASH2_ONLY = ("attention_conv.", "mlp_conv.", "candidate_selector.")


def text_config(vocab: int = 263, hidden: int = 32, layers: int = 4) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        tie_word_embeddings=True,
        pad_token_id=None,
        eos_token_id=None,
        bos_token_id=None,
    )


def draft_config(variant: str, tcfg, mask_id: int, block_size: int = 4, layers: int = 2, **kw) -> DFlashConfig:
    extra = dict(conv_group_size=8, selector_rank=16, selector_top_k=6) if variant == "dflash2" else {}
    extra.update(kw)
    return DFlashConfig.from_target_config(
        tcfg, mask_token_id=mask_id, variant=variant, num_hidden_layers=layers, block_size=block_size, **extra
    )


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.2, only: tuple[str, ...] = ()) -> None:
    """Perturb (a subset of) the weights so identity convolutions and the zero codebook no longer hide bugs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not only or any(o in name for o in only):
                p.add_(torch.randn(p.shape, generator=g) * scale)


def paired_drafts(tcfg, mask_id, block_size=4):
    """A DFlash draft and a fresh DFlash2 draft holding the same shared weights."""
    torch.manual_seed(0)
    v1 = DFlashDraftModel(draft_config("dflash", tcfg, mask_id, block_size)).eval()
    v2 = DFlash2DraftModel(draft_config("dflash2", tcfg, mask_id, block_size)).eval()
    missing, unexpected = v2.load_state_dict(v1.state_dict(), strict=False)
    assert not unexpected and missing and all(any(k in m for k in DFLASH2_ONLY) for m in missing)
    return v1, v2


def block_inputs(cfg: DFlashConfig, seed: int = 0, b: int = 2, s: int = 20):
    """Taps, doc ids, blocks (3 anchors per row, one unused) and noise embeddings for a training-layout forward."""
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(b, s, cfg.num_taps * cfg.hidden_size, generator=g)
    am = torch.ones(b, s, dtype=torch.long)
    am[1, 16:] = 0
    ids = torch.randint(3, min(cfg.vocab_size, 200), (b, s), generator=g)
    doc = doc_ids_from(am)
    anchors = torch.tensor([[3, 9, 14], [5, 11, -1]])
    blocks = build_blocks(ids, ids, am.bool(), doc, row_positions(am), anchors, cfg.block_size, cfg.mask_token_id, 4.0)
    noise = torch.randn(b, 3 * cfg.block_size, cfg.hidden_size, generator=g)
    return taps, doc, blocks, noise


def run_blocks(draft, taps, doc, blocks, noise):
    b, n, bs = blocks.ids.shape
    mask = attention_mask_for("sdpa", blocks.anchors, doc, bs)
    pos = torch.cat([row_positions(doc >= 0), blocks.positions.view(b, -1)], 1)
    out = draft(position_ids=pos, attention_mask=mask, noise_embedding=noise, target_hidden=taps)
    return out.view(b, n, bs, -1)


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------
def test_fresh_dflash2_computes_exactly_dflash():
    tcfg = text_config()
    v1, v2 = paired_drafts(tcfg, mask_id=262)
    taps, doc, blocks, noise = block_inputs(v1.config)
    with torch.no_grad():
        h1, h2 = run_blocks(v1, taps, doc, blocks, noise), run_blocks(v2, taps, doc, blocks, noise)
    assert torch.equal(h1, h2)
    layer = v2.layers[0].attention_conv
    assert torch.equal(layer.base_kernel[:, 0], torch.ones_like(layer.base_kernel[:, 0]))
    assert layer.base_kernel[:, 1:].abs().sum() == 0 and layer.kernel_projection.weight.abs().sum() == 0
    sel = v2.candidate_selector
    assert sel.successor_codebook.abs().sum() == 0
    assert abs(sel.predecessor_codebook.std().item() - 0.02) < 0.002
    # A fresh selector (zero successor codebook) walks to the plain argmax of the draft logits.
    lm_head = torch.nn.Linear(32, tcfg.vocab_size, bias=False)
    tokens, q = v2.propose_block(h2[0, 0], lm_head, anchor_token=7)
    assert q is None and torch.equal(tokens, lm_head(h2[0, 0, 1:]).argmax(-1))


def test_bad_dflash2_config_is_refused_before_allocation():
    tcfg = text_config(vocab=40)
    with pytest.raises(ValueError, match="selector_top_k 64 exceeds vocab_size 40"):
        DFlash2DraftModel(draft_config("dflash2", tcfg, 39, selector_top_k=64))
    cfg = draft_config("dflash2", tcfg, 39)
    cfg.dflash_config["conv_group_size"] = 5
    with pytest.raises(ValueError, match="conv_group_size 5 must divide hidden_size 32"):
        DFlash2DraftModel(cfg)


def test_convolution_formula_and_block_boundaries():
    cfg = draft_config("dflash2", text_config(), 262, block_size=4, conv_kernel_size=3)
    conv = DFlash2DraftModel(cfg).layers[0].mlp_conv
    randomize(conv, seed=1, scale=0.5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 32, generator=g)  # 3 blocks of 4 slots
    sub = torch.nn.Linear(32, 32)
    with torch.no_grad():
        out = conv(x, sub)
        # Brute force: out[t, c] = sum_o (base[s, o, c] + delta[t, s, o, c // G]) * x[t - o, c], same block only.
        delta = conv.kernel_projection(x).view(2, 12, 2, 3, 4)

        def ref_conv(z, side):
            r = torch.zeros_like(z)
            for t in range(12):
                for o in range(3):
                    if t % 4 - o >= 0:
                        k = conv.base_kernel[side, o] + delta[:, t, side, o].repeat_interleave(8, dim=-1)
                        r[:, t] += k * z[:, t - o]
            return r

        torch.testing.assert_close(out, ref_conv(sub(ref_conv(x, 0)), 1), atol=1e-5, rtol=1e-5)
        x2 = x.clone()
        x2[:, 4] += 3.0  # slot 0 of block 1
        d = (conv(x2, sub) - out).abs().amax(-1)  # [2, 12]
        assert d[:, :4].max() == 0 and d[:, 8:].max() == 0  # blocks 0 and 2 untouched
        assert d[:, 5].min() > 1e-4 and d[:, 6].min() > 1e-4  # the taps mix neighbours inside block 1
        x3 = x.clone()
        x3[:, 7] += 3.0  # last slot of block 1: nothing after it in the block, never the next block
        d = (conv(x3, sub) - out).abs().amax(-1)
        assert d[:, 8:].max() == 0 and d[:, 7].min() > 1e-4 and d[:, 4:7].max() == 0


def test_full_draft_keeps_blocks_independent():
    tcfg = text_config()
    _, v2 = paired_drafts(tcfg, mask_id=262)
    randomize(v2, seed=2, only=DFLASH2_ONLY)
    taps, doc, blocks, noise = block_inputs(v2.config)
    with torch.no_grad():
        base = run_blocks(v2, taps, doc, blocks, noise)
        nz = noise.clone()
        nz[0, 4] += 5.0  # slot 0 of block 1, row 0
        d = (run_blocks(v2, taps, doc, blocks, nz) - base).abs().amax(dim=(-1, -2))  # [b, N]
    assert d[0, 0] == 0 and d[0, 2] == 0 and d[1].max() == 0 and d[0, 1] > 1e-4


# ------------------------------------------------------------------------------------------------
# Losses
# ------------------------------------------------------------------------------------------------
def _selector_reference(hidden, blocks, weight, selector, anchors, labels_full, ids_full):
    """Per-slot loop: full logits, top-k, explicit pair scores, CE where the label is a candidate."""
    b, n, bs, _ = hidden.shape
    sel_sum, sel_den, n_hit = hidden.new_zeros(()), 0.0, 0
    k_top = selector.top_k
    for r in range(b):
        for j in range(n):
            a = int(anchors[r, j])
            for k in range(1, bs):
                if not blocks.valid[r, j, k - 1]:
                    continue
                h = hidden[r, j, k]
                logits = weight @ h
                unary, cand = logits.topk(k_top)
                prev = int(ids_full[r, a]) if k == 1 else int(labels_full[r, a + k - 1])
                label = int(labels_full[r, a + k])
                assert int(blocks.predecessors[r, j, k - 1]) == prev
                hp = selector.hidden_projection.weight @ h
                scores = torch.stack(
                    [
                        unary[i] + (selector.predecessor_codebook[prev] * hp * selector.successor_codebook[c]).sum()
                        for i, c in enumerate(cand.tolist())
                    ]
                )
                if label in cand.tolist():
                    w = float(torch.exp(torch.tensor(-(k - 1) / 4.0)))
                    target = cand.tolist().index(label)
                    sel_sum = sel_sum + w * F.cross_entropy(scores[None], torch.tensor([target]))
                    sel_den += w
                    n_hit += 1
    return sel_sum, sel_den, n_hit


def test_selector_ce_matches_brute_force_and_base_matches_dflash():
    vocab = 12
    tcfg = text_config(vocab=vocab)
    cfg = draft_config("dflash2", tcfg, mask_id=11, block_size=4, selector_top_k=4)
    draft = DFlash2DraftModel(cfg)
    randomize(draft.candidate_selector, seed=3, scale=0.5)
    selector = draft.candidate_selector
    g = torch.Generator().manual_seed(4)
    b, s = 2, 16
    ids = torch.randint(0, 10, (b, s), generator=g)
    labels = torch.randint(0, 10, (b, s), generator=g)  # differs from ids: predecessors must read labels
    loss_mask = torch.ones(b, s, dtype=torch.bool)
    loss_mask[:, :3] = False
    loss_mask[1, 9] = False  # a hole: slot k valid while slot k-1 is not
    am = torch.ones(b, s, dtype=torch.long)
    doc = doc_ids_from(am)
    anchors = torch.tensor([[3, 7, 13], [4, 8, 12]])
    blocks = build_blocks(ids, labels, loss_mask, doc, row_positions(am), anchors, 4, 11, 4.0)
    weight = torch.randn(vocab, 32, generator=g)
    hidden = torch.randn(b, 3, 4, 32, generator=g, requires_grad=True)

    out = dflash2_block_loss(hidden, blocks, weight, selector, chunk_size=5)  # several chunks
    ref_sum, ref_den, n_hit = _selector_reference(hidden, blocks, weight, selector, anchors, labels, ids)
    assert 0 < n_hit < int(blocks.valid.sum())  # some labels outside the top-k
    torch.testing.assert_close(out.selector.loss_sum, ref_sum, atol=1e-5, rtol=1e-5)
    assert abs(out.selector.weight_sum.item() - ref_den) < 1e-5
    assert int(out.candidate_hits.sum()) == n_hit
    # Gradients through the checkpointed chunks equal the reference's.
    grads = torch.autograd.grad(out.selector.loss_sum, [hidden, selector.successor_codebook])
    ref_grads = torch.autograd.grad(ref_sum, [hidden, selector.successor_codebook])
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    # The base part is exactly DFlash's decayed CE.
    base = block_loss(hidden, blocks, weight, chunk_size=5)
    torch.testing.assert_close(out.loss_sum, base.loss_sum)
    assert torch.equal(out.correct, base.correct) and out.weight_sum == base.weight_sum
    # Metrics: selector/recall ratios next to the base ones.
    sums = MetricSums(prefix="eval_")
    sums.add_block_loss(out)
    m = sums.reduce()
    assert abs(m["eval_candidate_recall"] - n_hit / int(blocks.valid.sum())) < 1e-9
    assert abs(m["eval_selector_loss"] - ref_sum.item() / ref_den) < 1e-5
    assert {"eval_loss", "eval_tau_est", "eval_selector_tau_est", "eval_selector_accuracy"} <= set(m)
    assert 1.0 <= m["eval_selector_tau_est"] <= 4.0


def test_no_valid_slot_gives_differentiable_zero_with_grads_everywhere():
    cfg = draft_config("dflash2", text_config(vocab=12), mask_id=11, block_size=4, selector_top_k=4)
    draft = DFlash2DraftModel(cfg)
    ids = torch.randint(0, 10, (1, 8))
    am = torch.ones_like(ids)
    doc = doc_ids_from(am)
    blocks = build_blocks(ids, ids, am.bool(), doc, row_positions(am), torch.full((1, 2), -1), 4, 11, 4.0)
    hidden = torch.randn(1, 2, 4, 32, requires_grad=True)
    out = dflash2_block_loss(hidden, blocks, torch.randn(12, 32), draft.candidate_selector, chunk_size=1024)
    (out.loss_sum + out.selector.loss_sum).backward()
    assert out.loss_sum.item() == 0 and out.selector.loss_sum.item() == 0 and out.selector.weight_sum == 0
    assert all(p.grad is not None for p in draft.candidate_selector.parameters())  # DDP needs every grad


# ------------------------------------------------------------------------------------------------
# Trainer
# ------------------------------------------------------------------------------------------------
def dflash2_trainer(tmp_path, model, tok, rows, variant="dflash2", draft=None, **kw):
    kw = dict(
        output_dir=str(tmp_path / variant),
        variant=variant,
        per_device_train_batch_size=len(rows),
        conv_group_size=8,
        selector_rank=16,
        selector_top_k=8,
        **kw,
    )
    return make_trainer(tmp_path, model, tok, rows, draft=draft, **kw)


def test_training_args_refuse_fused_ce_and_negative_selector_weight(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="DFlash2 needs the dense draft logits"):
        DFlashTrainingArguments(variant="dflash2", use_fused_linear_ce=True, **base)
    with pytest.raises(ValueError, match="selector_loss_weight must be >= 0"):
        DFlashTrainingArguments(variant="dflash2", selector_loss_weight=-1.0, **base)


def test_trainer_loss_is_base_plus_weighted_selector(tmp_path):
    model, tok = tiny_text_target(hidden_size=32)
    rows = [(list(range(40, 48)), list(range(60, 80))), (list(range(50, 56)), list(range(90, 104)))]
    batch = text_batch(rows, tok.pad_token_id)
    trainer = dflash2_trainer(tmp_path, model, tok, rows)  # builds a fresh DFlash2 draft from the args
    draft = trainer.model
    assert isinstance(draft, DFlash2DraftModel) and draft.config.dflash_config["selector_top_k"] == 8
    # selector_loss_weight 0: exactly the loss of a DFlash draft with the same shared weights.
    v1 = DFlashDraftModel(draft_config("dflash", trainer.target.text_config, draft.config.mask_token_id))
    v1.load_state_dict({k: v for k, v in draft.state_dict().items() if not any(o in k for o in DFLASH2_ONLY)})
    ref = dflash2_trainer(tmp_path, model, tok, rows, variant="dflash", draft=v1)
    zero_w = dflash2_trainer(tmp_path, model, tok, rows, draft=draft, selector_loss_weight=0.0)
    torch.testing.assert_close(zero_w.compute_loss(draft, dict(batch)), ref.compute_loss(v1, dict(batch)))

    randomize(draft, seed=5, only=DFLASH2_ONLY)

    loss, out = trainer.compute_loss(draft, dict(batch), return_outputs=True)
    base = out.loss_sum / out.weight_sum
    sel = out.selector.loss_sum / out.selector.weight_sum
    assert out.selector.weight_sum > 0
    torch.testing.assert_close(loss, base + sel)
    # A gradient-accumulation step of G micro-batches: base by the global denominator, selector by its
    # own micro-batch denominator over G (see DFlashTrainer.selector_loss).
    trainer.current_gradient_accumulation_steps = 2
    plan = trainer.objective.plan(trainer.target, batch, 0)
    step = trainer.compute_loss(draft, dict(batch), plan=plan, num_items_in_batch=2 * out.weight_sum)
    torch.testing.assert_close(step, out.loss_sum / (2 * out.weight_sum) + sel / 2)
    m = trainer.train_sums.reduce()
    for name in ("loss", "tau_est", "selector_loss", "selector_tau_est", "selector_accuracy", "candidate_recall"):
        assert name in m, (name, sorted(m))
    assert 0.0 < m["candidate_recall"] <= 1.0
    logged = trainer._report(trainer.train_sums)  # what the Trainer logs: the optimized objective
    assert logged["loss"] == pytest.approx(logged["base_loss"] + logged["selector_loss"])
    assert logged["base_loss"] == pytest.approx(m["loss"])


# ------------------------------------------------------------------------------------------------
# Checkpoint contract, remote code, conversion
# ------------------------------------------------------------------------------------------------
REMOTE_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys, torch
    from transformers import AutoModel
    assert importlib.util.find_spec("dflash_hf") is None, "dflash_hf must not be importable here"
    out = {}
    for name in ("v1", "v2"):
        model = AutoModel.from_pretrained(sys.argv[1] + "/" + name, trust_remote_code=True).eval()
        inputs = torch.load(sys.argv[1] + "/inputs.pt")
        with torch.no_grad():
            torch.save(model(**inputs), sys.argv[1] + f"/{name}_out.pt")
        out[name] = [type(model).__name__, type(model).__module__]
    print(json.dumps(out))
    """
)


@pytest.mark.compat
@pytest.mark.slow  # a fresh interpreter loads the export: ~10 s
def test_export_contract_and_remote_code_round_trip(tmp_path):
    tcfg = text_config()
    v1, v2 = paired_drafts(tcfg, mask_id=262)
    randomize(v2, seed=6)
    v1.save_pretrained(tmp_path / "v1")
    v2.save_pretrained(tmp_path / "v2")
    raw = json.loads((tmp_path / "v2" / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["model_type"] == "qwen3"
    assert raw["auto_map"]["AutoModel"] == "modeling_dflash.DFlash2DraftModel"
    assert json.loads((tmp_path / "v1" / "config.json").read_text())["auto_map"]["AutoModel"] == (
        "modeling_dflash.DFlashDraftModel"
    )
    assert {
        k: raw["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    } == dict(conv_kernel_size=2, conv_group_size=8, selector_rank=16, selector_top_k=6)
    with safe_open(str(tmp_path / "v2" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert {f"layers.{i}.{conv}.base_kernel", f"layers.{i}.{conv}.kernel_projection.weight"} <= names
    assert {
        f"candidate_selector.{n}" for n in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight")
    } <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    # In-process loads keep the saved weights (post_init must not re-initialize them).
    loaded, info = DFlash2DraftModel.from_pretrained(tmp_path / "v2", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    strict = load_draft_strict(tmp_path / "v2")
    for k, v in v2.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v) and torch.equal(strict.state_dict()[k], v), k
    assert type(strict) is DFlash2DraftModel
    # Remote code in a fresh interpreter without dflash_hf: no site processing (so the editable-install
    # finder is never registered), only the venv's site-packages on the path, cwd outside the repo.
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        position_ids=torch.arange(10 + 8)[None],
        noise_embedding=torch.randn(1, 8, 32, generator=g),
        target_hidden=torch.randn(1, 10, 2 * 32, generator=g),
    )
    torch.save(inputs, tmp_path / "inputs.pt")
    (tmp_path / "remote.py").write_text(REMOTE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_MODULES_CACHE=str(tmp_path / "modules"),
        PYTHONPATH=sysconfig.get_paths()["purelib"],
        OMP_NUM_THREADS=str(torch.get_num_threads()),
    )  # same reduction order as this process
    proc = subprocess.run(
        [sys.executable, "-S", str(tmp_path / "remote.py"), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    classes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert classes["v1"][0] == "DFlashDraftModel" and classes["v2"][0] == "DFlash2DraftModel"
    assert all(mod.startswith("transformers_modules.") for _, mod in classes.values())
    with torch.no_grad():
        for name, model in (("v1", v1), ("v2", v2)):
            torch.testing.assert_close(torch.load(tmp_path / f"{name}_out.pt"), model(**inputs), atol=0, rtol=0)


def test_conversion_script_bootstraps_identity_dflash2(tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        from convert_dflash_to_dflash2 import main
    finally:
        sys.path.pop(0)
    tcfg = text_config()
    torch.manual_seed(0)
    v1 = DFlashDraftModel(draft_config("dflash", tcfg, 262)).eval()
    randomize(v1, seed=7, scale=0.05)
    v1.save_pretrained(tmp_path / "v1")
    args = [str(tmp_path / "v1"), str(tmp_path / "v2"), "--conv_group_size", "8", "--selector_rank", "16"]
    assert main(args) == 0
    v2 = load_draft_strict(tmp_path / "v2").eval()  # strict: any missing/unexpected tensor would raise
    assert type(v2) is DFlash2DraftModel and v2.config.dflash_config["selector_top_k"] == 16
    for k, v in v1.state_dict().items():
        assert torch.equal(v2.state_dict()[k], v), k
    assert v2.candidate_selector.successor_codebook.abs().sum() == 0
    taps, doc, blocks, noise = block_inputs(v1.config)
    with torch.no_grad():
        assert torch.equal(run_blocks(v1, taps, doc, blocks, noise), run_blocks(v2, taps, doc, blocks, noise))
    with pytest.raises(ValueError, match="already a DFlash2DraftModel"):
        main([str(tmp_path / "v2"), str(tmp_path / "v3")])


# ------------------------------------------------------------------------------------------------
# Speculative decoding
# ------------------------------------------------------------------------------------------------
@pytest.mark.compat
@pytest.mark.slow  # 8 s on 2 busy cores
def test_greedy_selector_walk_is_lossless():
    model, tok = tiny_text_target(seed=1)
    tiny.sharpen(model, seed=1)
    mask_id = tok.convert_tokens_to_ids(tiny.MASK_TOKEN)
    torch.manual_seed(0)
    draft = DFlash2DraftModel(
        draft_config("dflash2", model.config, mask_id, block_size=5, conv_group_size=16, selector_top_k=16)
    ).eval()
    randomize(draft, seed=8, scale=0.3, only=("successor_codebook", "mlp_conv"))
    assert_lossless_greedy(draft, model, num_prompts=2, max_new_tokens=16)


@pytest.mark.compat
@pytest.mark.slow  # 43 s on 2 busy cores
def test_sampled_selector_walk_keeps_the_target_distribution():
    """One draft/verify cycle at T > 0, many times: the two tokens emitted after the anchor t1 (accepted
    draft tokens, residual resample or bonus) must follow the target's p(t2 | t1) p(t3 | t1, t2).
    Top-2 candidates of a 4-token vocabulary and a strong random successor codebook make the selector's
    proposals differ from the target, so acceptance, rejection and tokens outside the candidates all occur."""
    vocab, temp, block, per_anchor = 4, 1.5, 3, 600
    tcfg = text_config(vocab=vocab, layers=2)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(tcfg).eval()
    tiny.sharpen(target, seed=3, embed_std=0.3, layer_std=0.2)
    draft = DFlash2DraftModel(
        draft_config("dflash2", tcfg, mask_id=3, block_size=block, selector_top_k=2, layers=1, target_layer_ids=[0])
    ).eval()
    randomize(draft, seed=9, scale=0.6, only=("candidate_selector",))  # pair term of the order of the logits
    prompt = torch.tensor([0, 1, 2, 1])
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V^2, 2]: (t1, t2)
    with torch.no_grad():
        logits = target(input_ids=torch.cat([prompt.expand(len(pairs), -1), pairs], 1)).logits[:, -2:]
    # target_logits[t1]: rows of the verify forward of block [t1, d1, d2] that the cycle reads:
    # after t1 (row 0) and after (t1, d1) (row 1); row 2 (bonus) is not needed for two tokens.
    after_t1 = logits[::vocab, 0]  # [V, V]
    after_t1_t2 = logits[:, 1].view(vocab, vocab, vocab)  # [t1, t2, V]
    p1, p2 = torch.softmax(after_t1.double() / temp, -1), torch.softmax(after_t1_t2.double() / temp, -1)
    gen = torch.Generator().manual_seed(0)
    hiddens = 0.2 * torch.randn(vocab, block, tcfg.hidden_size, generator=gen)  # any hidden: lossless anyway
    counts, expected, stats = Counter(), {}, Counter()
    for t1 in range(vocab):
        for t2 in range(vocab):
            for t3 in range(vocab):
                expected[(t1, t2, t3)] = per_anchor * float(p1[t1, t2] * p2[t1, t2, t3])
        for _ in range(per_anchor):
            tokens, q = draft.propose_block(hiddens[t1], target.lm_head, t1, temp, gen)
            assert torch.allclose(q.sum(-1), torch.ones(block - 1)) and int((q > 0).sum(-1).max()) <= 2
            verify = torch.stack([after_t1[t1], after_t1_t2[t1, tokens[0]], after_t1[t1]])  # row 2 unused
            k, nxt = accept_tokens(tokens, q, verify, temp, gen)
            emitted = (tokens[:k].tolist() + [nxt])[:2]
            if len(emitted) < 2:  # rejected at slot 1: t3 comes from the next cycle, i.e. p(. | t1, t2)
                emitted.append(int(torch.multinomial(p2[t1, emitted[0]].float(), 1, generator=gen)))
            counts[(t1, *emitted)] += 1
            stats[f"accepted_{k}"] += 1
            stats["outside_candidates"] += int(q[0, emitted[0]] == 0)
    total = vocab * per_anchor
    assert stats["accepted_0"] > 0.1 * total and stats["accepted_2"] > 0.03 * total, stats
    assert stats["outside_candidates"] > 0.02 * total, stats
    p_value, dof = chi_square_p_value(counts, expected)
    assert dof >= 20 and p_value > 1e-3, (p_value, dof, stats)
