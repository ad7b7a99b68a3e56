"""Draft/verify speculative decoding against the (audio) target (README, "Use the exported draft").

One cycle: the draft proposes `B-1` tokens for the block `[x_a, M, ..., M]` at positions
`a..a+B-1` from the target features of every position `< a` (kept as a draft KV cache), the target
verifies the block in one forward, the longest agreeing prefix plus the target's bonus token is
appended, and the features of the verified positions join the draft context. Decoding stops at the first
stop token anywhere among a cycle's accepted tokens; the cycle's acceptance length counts only the tokens up
to and including it. With `tree_budget`, a cycle verifies a token tree of that many nodes from the same draft
forward instead of the chain (`dflash_hf.generation.tree_decode`).

The target's scores go through its logits processors before any decision (Whisper's suppressed and
begin-suppressed tokens, and the temperature when sampling), so greedy decoding is exactly the target's
greedy `generate`, and at `temperature > 0` rejection sampling keeps the target's distribution (Leviathan et
al.). Encoder-decoder targets (Whisper) decode through their own `generate` with
:class:`DFlashCustomGenerate` as `custom_generate`: the prompt, processors, stopping criteria and encoder
output are the model's own; the encoder runs once per utterance and the cross-attention cache is kept for it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, EncoderDecoderCache, LogitsProcessorList, TemperatureLogitsWarper
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from dflash_hf.generation.decode_options import DecodeOptions
from dflash_hf.generation.decode_state import (
    DecoderPositions,
    SpeculativeOutput,
    TargetVerifier,
    crop_cache,
)
from dflash_hf.generation.fixed_draft import fixed_draft_step
from dflash_hf.generation.fixed_verify import check_verify_step, fixed_verify_step
from dflash_hf.generation.model_side import model_side_what
from dflash_hf.generation.prompt_padding import check_one_prompt, prompt_padding, refuse_padding
from dflash_hf.generation.target_cache import check_block_cached, check_prompt_cached, generate_state_free
from dflash_hf.generation.tree_decode import TreeDecode
from dflash_hf.generation.tree_verify import check_tree_target
from dflash_hf.generation.verify_rules import (
    FirstStop,
    accept_prefix,
    criteria_stop,
    eos_or_length_stop,
    eos_token_ids,
    max_new_tokens_given,
    pick_tokens,
    processed_scores,
    propose_block,
    with_cached_masks,
)
from dflash_hf.targets.frozen import FrozenTarget, TargetModel


def decode_loop(
    draft,
    verifier: TargetVerifier,
    prefill: dict,
    prompt: torch.Tensor,
    *,
    processors: LogitsProcessorList,
    sample: bool,
    draft_temperature: float,
    first_stop: FirstStop,
    max_positions: int | None,
    generator,
    max_length: int | None = None,
    options: DecodeOptions,
) -> tuple[torch.Tensor, list[int]]:
    """The draft/verify loop. `prefill`: the first target forward's keywords (the whole prompt); `prompt`
    `[1, L]` the token ids it ends with. Target scores are `processors`-processed logits (temperature included
    when `sample`); `first_stop` finds the first new token that ends decoding.
    `max_positions` caps decoder positions (Whisper's 448), `max_length` the token count (prompt included) where
    decoding stops. `options`: the draft's step and the target's verify as fixed-shape forwards (the graph modes are
    greedy only), and tree verification (`DecodeOptions`). Returns the sequence and acceptance lengths."""
    ft = verifier.target
    cfg = draft.config
    bsz, mask_id = cfg.block_size, cfg.mask_token_id
    dev = prompt.device
    draft_dtype = next(draft.parameters()).dtype
    target_t = 1.0 if sample else 0.0  # scores already carry the temperature
    processors = with_cached_masks(processors)  # suppression masks built once per decode, not per cycle
    dcache = DynamicCache()
    draft_kwargs = {}
    if cfg.encoder_context:  # the opt-in outside the contract: the draft reads the encoder frames, once per utterance
        encoder_outputs = verifier.step_kwargs.get("encoder_outputs")
        if encoder_outputs is None:
            raise ValueError(
                "this draft attends to encoder frames (dflash_config.encoder_hidden_size), but the target "
                "is not an encoder-decoder model; use a draft without encoder context"
            )
        draft_kwargs = {"encoder_hidden_states": encoder_outputs[0], "encoder_cache": {}}  # keys/values kept

    tree = None  # tree verification (refused here, before the prompt's forward, where the target cannot take it)
    if options.tree_budget is not None:
        tree = TreeDecode(draft, ft, options.tree_budget, sample=sample, draft_temperature=draft_temperature)
    if ft.keeps_last_logits_only:  # only the prompt's last position is scored: no [prompt, vocab] logits
        prefill = {**prefill, "logits_to_keep": 1}
    if options.verify_cuda_graph:
        check_verify_step(
            ft, bsz, verifier.step_kwargs, sample=sample, max_positions=max_positions, max_length=max_length
        )
    logits, pending = verifier(**prefill)
    check_prompt_cached(verifier.cache, pending.shape[1], prompt.shape[1], ft.model)
    # Decoder positions minus token positions: > 0 when the model expands audio placeholders itself.
    expansion = pending.shape[1] - prompt.shape[1]
    padding, skipped = verifier.padding, 0  # the draft's positions run `skipped` behind the target's cache rows
    if padding is not None:
        if expansion:
            raise ValueError(
                f"{type(ft.model).__name__} expands its audio placeholder itself: speculative decoding takes its "
                "prompt unpadded (pass the prompt without padding)"
            )
        pending, skipped = pending[:, padding.keep], padding.skipped  # the draft's context: real positions only
    scores = processed_scores(processors, prompt, logits[-1:])
    nxt, _ = pick_tokens(scores, target_t, generator)
    # Host state, so that a cycle reads the device once (its acceptance): the anchor id (the last token of `seq`)
    # and the draft's first position of `pending` (its positions run from there to the block's end).
    anchor, pending_start = int(nxt), 0
    positions = DecoderPositions(dev)
    masks = torch.full((1, bsz - 1), mask_id, device=dev, dtype=torch.long)
    # after the prefill: the fixed-shape verify copies the prompt's rows (and Whisper's cross-attention keys)
    verify_step = fixed_verify_step(
        options.verify_cuda_graph,
        ft,
        verifier.layer_ids,
        bsz,
        verifier.cache,
        verifier.step_kwargs,
        sample=sample,
        max_positions=max_positions,
        max_length=max_length,
        expansion=expansion,
        padding=padding,
        **({} if tree is None else {"nodes": tree.nodes + 1, "kind": tree.step_kind}),
    )
    if verify_step is not None:
        verifier.verify_step = "cuda graph" if verify_step.graph is not None else "fixed-shape, no graph"
    draft_step = fixed_draft_step(
        options.draft_cuda_graph,
        draft,
        ft,
        bsz,
        draft_kwargs.get("encoder_hidden_states"),
        device=dev,
        sample=sample,
        max_positions=max_positions,
        max_length=max_length,
        expansion=expansion,
        head=None if tree is None else tree.head,
    )
    if draft_step is not None:  # the fixed-shape draft step (a CUDA graph on the GPU)
        verifier.draft_step = "cuda graph" if draft_step.graph is not None else "fixed-shape, no graph"
    seq = torch.cat([prompt, nxt.view(1, 1).to(prompt.dtype)], dim=1)
    accepted: list[int] = []
    stopped = first_stop(seq, prompt.shape[1], scores, [anchor]) is not None
    while not stopped:
        a = seq.shape[1] - 1 + expansion  # anchor's decoder position: last verified token, not yet run
        a_draft = a - skipped  # and the draft's (no padding)
        width = bsz if max_positions is None else min(bsz, max_positions - a)
        anchor_ids = seq[:, -1:]
        if draft_step is not None:  # a whole block always (its slots past `width` are not verified)
            drafted = draft_step.propose(ft, pending, pending_start, anchor_ids)
        else:  # a whole block always too (DFlash2's convolutions take whole blocks), its proposal cut to `width`
            block_ids = torch.cat([anchor_ids, masks], dim=1)
            pos = positions.span(pending_start, a_draft + bsz)  # the pending features' positions, then the block's
            drafted = draft(
                position_ids=pos,
                noise_embedding=ft.embed_tokens(block_ids).to(draft_dtype),
                target_hidden=pending.to(draft_dtype),
                past_key_values=dcache,
                use_cache=True,
                **draft_kwargs,
            )[0]
            crop_cache(dcache, a_draft)  # keep the context, drop the block
        if tree is not None:
            nodes, q = tree.tree(draft, drafted, anchor, generator)
            out, scores, pending = tree.cycle(verifier, verify_step, processors, seq, a, width - 1, nodes, q, generator)
            k, new, new_ids = out.k, out.new, out.new_ids
        else:
            if draft_step is not None:
                proposal, q = drafted[: width - 1], None
            else:
                proposal, q = propose_block(
                    draft, drafted.to(ft.dtype), ft.lm_head, anchor, draft_temperature if sample else 0.0, generator
                )
                proposal, q = proposal[: width - 1], None if q is None else q[: width - 1]
            verify_ids = torch.cat([anchor_ids, proposal.view(1, -1)], dim=1)
            if verify_step is None:
                logits, feats = verifier.step(verify_ids, a)
                check_block_cached(verifier.cache, a + verify_ids.shape[1], ft.model)
            else:  # fixed tensors, overwritten by the next verify (the draft reads `pending` before it)
                logits, feats = verify_step.verify(ft, verify_ids, a)
                verifier.forwards += 1
            scores = processed_scores(processors, seq, logits, proposal)  # row i follows seq + proposal[:i]
            k, new, new_ids = accept_prefix(proposal, q, scores, target_t, generator)
            if verify_step is None:  # fixed buffers: the next block overwrites the rejected rows
                crop_cache(verifier.cache, a + k + 1)
            pending = feats[:, : k + 1]
        grown, length = torch.cat([seq, new.view(1, -1).to(seq.dtype)], dim=1), seq.shape[1]
        stop = first_stop(grown, length, scores, new_ids)  # the first stop token anywhere among the accepted ones
        stopped, kept = stop is not None, k + 1 if stop is None else stop + 1
        seq = grown[:, : length + kept]
        accepted.append(kept)
        anchor, pending_start = new_ids[kept - 1], a_draft
    return seq, accepted


@torch.no_grad()
def speculative_generate(
    draft: nn.Module,
    target: TargetModel,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    draft_cuda_graph: bool | None = None,
    verify_cuda_graph: bool | None = None,
    tree_budget: int | None = None,
    options: DecodeOptions | None = None,
    **target_inputs,
) -> SpeculativeOutput:
    """Decode one prompt with draft proposals verified by the target.

    `target` is the HF model (text or audio); `target_inputs` exactly what its processor returns for
    one prompt (`input_ids`, `attention_mask`, `input_features`, ...). Encoder-decoder targets (Whisper) take
    `input_features` and optionally `decoder_input_ids` (default: the prompt the target's `generate` forces);
    their `sequences` are the decoder ids (prompt + new tokens), as `generate(..., return_dict_in_generate=True)`
    returns them. `draft_cuda_graph` (greedy): None replays the draft's step as a CUDA graph on a GPU, False keeps
    the eager draft forward, True also runs the fixed-shape step on the CPU (`dflash_hf.generation.fixed_draft`);
    the output
    is the same either way. `verify_cuda_graph` (greedy): the target's verify as a fixed-shape forward, the same
    three ways (`dflash_hf.generation.fixed_verify`; its logits equal the growing cache's up to rounding).
    `tree_budget`: None verifies the draft's chain (its top token at each slot); an int verifies a token tree of that
    many nodes a cycle in one target forward (`dflash_hf.generation.tree_decode`; lossless as the chain).
    `options`: the three as one `DecodeOptions` (instead of the keywords)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    options = DecodeOptions.of(options, draft_cuda_graph, verify_cuda_graph, tree_budget)
    ft = FrozenTarget.of(target)
    if options.tree_budget is not None:  # before `generate` prepares anything (Whisper's encoder pass)
        check_tree_target(ft)
    if ft.family.expansion != "model":
        # The target's own `generate` (its prompt, generation config's logits processors, stopping criteria and,
        # for Whisper, encoder pass) with `DFlashCustomGenerate` decoding: plain `generate`'s output by construction.
        return _through_generate(draft, ft, max_new_tokens, temperature, generator, target_inputs, options)
    # Model-side single-placeholder targets (legacy Qwen2-Audio / SALM layout): transformers' `generate` drops the 2D
    # mask their audio merge needs, so they decode here, with the end tokens of their configs and temperature only.
    input_ids = target_inputs["input_ids"]
    check_one_prompt(input_ids)
    refuse_padding(target_inputs.get("attention_mask"), model_side_what(ft))
    eos = eos_token_ids(ft)
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)] if temperature > 0 else [])
    verifier = TargetVerifier(ft, list(draft.config.target_layer_ids), "input_ids", DynamicCache())
    seq, accepted = decode_loop(
        draft,
        verifier,
        ft.cast_features(target_inputs),
        input_ids,
        processors=processors,
        sample=temperature > 0,
        draft_temperature=temperature,
        first_stop=eos_or_length_stop(eos, input_ids.shape[1] + max_new_tokens),
        max_positions=None,
        generator=generator,
        max_length=input_ids.shape[1] + max_new_tokens,
        options=options,
    )
    return SpeculativeOutput(
        sequences=seq,
        acceptance_lengths=accepted,
        num_target_forwards=verifier.forwards,
        draft_step=verifier.draft_step,
        verify_step=verifier.verify_step,
    )


def _through_generate(
    draft,
    ft: FrozenTarget,
    max_new_tokens,
    temperature,
    generator,
    target_inputs,
    options: DecodeOptions,
):
    """The target's own `generate` (its prompt, Whisper's forced decoder prompt and encoder pass, its logits
    processors and stopping criteria) with :class:`DFlashCustomGenerate` doing the decoding."""
    key = ft.family.audio_kwargs[0] if ft.is_encoder_decoder else "input_ids"  # Whisper: input_features
    if key not in target_inputs:
        kind = f"an encoder-decoder target ({ft.family.name})" if ft.is_encoder_decoder else "a decoder-only target"
        raise ValueError(f"{kind} needs {key} (what its processor returns)")
    check_one_prompt(target_inputs[key])
    decode = DFlashCustomGenerate(draft, generator=generator, options=options)
    sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    with max_new_tokens_given():
        ft.model.generate(**target_inputs, max_new_tokens=max_new_tokens, custom_generate=decode, **sampling)
    return SpeculativeOutput(
        sequences=decode.sequences,
        acceptance_lengths=decode.acceptance_lengths,
        num_target_forwards=decode.num_target_forwards,
        draft_step=decode.draft_step,
        verify_step=decode.verify_step,
    )


class DFlashCustomGenerate:
    """`target.generate(**inputs, custom_generate=DFlashCustomGenerate(draft))`: transformers 5's `generate`
    prepares the prompt, the encoder output (encoder-decoder targets), the logits processors and the stopping
    criteria as it does for greedy or sampled decoding, then hands them to this callable, which decodes with
    DFlash draft proposals; the output equals plain `generate` (greedy: the same tokens; sampling: the same
    distribution). One prompt at a time. After a call, `sequences` (prompt + new tokens), `acceptance_lengths`
    and `num_target_forwards` describe it. The target is used as a `FrozenTarget` (eval mode, gradients off).
    `draft_cuda_graph`, `verify_cuda_graph`, `tree_budget`, `options`: as for :func:`speculative_generate`."""

    def __init__(
        self,
        draft,
        generator: torch.Generator | None = None,
        draft_cuda_graph: bool | None = None,
        verify_cuda_graph: bool | None = None,
        tree_budget: int | None = None,
        options: DecodeOptions | None = None,
    ):
        self.draft, self.generator = draft, generator
        self.options = DecodeOptions.of(options, draft_cuda_graph, verify_cuda_graph, tree_budget)
        self._target: FrozenTarget | None = None
        self.sequences: torch.LongTensor | None = None  # prompt + new tokens of the last call
        self.acceptance_lengths: list[int] = []
        self.num_target_forwards = 0
        self.draft_step = self.verify_step = "eager"  # how the last call's steps ran (`SpeculativeOutput`)

    def __call__(
        self,
        model,
        input_ids,
        logits_processor=None,
        stopping_criteria=None,
        generation_config=None,
        synced_gpus=False,
        streamer=None,
        **model_kwargs,
    ):
        check_one_prompt(input_ids)
        if streamer is not None:
            raise ValueError("DFlashCustomGenerate does not stream; call generate without streamer")
        if self._target is None or self._target.model is not model:
            self._target = FrozenTarget(model)
        ft = self._target
        kwargs = generate_state_free(model_kwargs)  # generate's cache stays out: the decode keeps its own
        layer_ids = list(self.draft.config.target_layer_ids)
        if ft.is_encoder_decoder:
            if kwargs.get("encoder_outputs") is None:
                raise ValueError("encoder-decoder decoding needs encoder_outputs (generate computes them)")
            refuse_padding(kwargs.get("decoder_attention_mask"), "speculative decoding of a decoder prompt")
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            verifier = TargetVerifier(
                ft,
                layer_ids,
                "decoder_input_ids",
                cache,
                step_kwargs={"encoder_outputs": kwargs.pop("encoder_outputs")},
            )
            prefill = {
                "decoder_input_ids": input_ids,
                **{k: v for k, v in kwargs.items() if k.startswith("decoder_") and k != "decoder_input_ids"},
            }
            max_positions = getattr(model.config, "max_target_positions", None)
        else:
            # a padded prompt: generate's mask and positions, kept for every forward (`prompt_padding`)
            padding = prompt_padding(kwargs.get("attention_mask"), kwargs.get("position_ids"), input_ids.shape[1])
            verifier = TargetVerifier(ft, layer_ids, "input_ids", DynamicCache(), padding=padding)
            prefill = {"input_ids": input_ids, **ft.cast_features(kwargs)}
            max_positions = None
        if not stopping_criteria:
            raise ValueError(
                "DFlashCustomGenerate needs stopping criteria (generate passes its max length and end "
                "token); call it through target.generate(..., custom_generate=...)"
            )
        sample = bool(getattr(generation_config, "do_sample", False))

        seq, accepted = decode_loop(
            self.draft,
            verifier,
            prefill,
            input_ids,
            processors=logits_processor or LogitsProcessorList(),
            sample=sample,
            draft_temperature=float(getattr(generation_config, "temperature", None) or 1.0),
            first_stop=criteria_stop(stopping_criteria),
            max_positions=max_positions,
            generator=self.generator,
            max_length=getattr(generation_config, "max_length", None),
            options=self.options,
        )
        self.sequences, self.acceptance_lengths, self.num_target_forwards = seq, accepted, verifier.forwards
        self.draft_step, self.verify_step = verifier.draft_step, verifier.verify_step
        if generation_config is not None and generation_config.return_dict_in_generate:
            cls = GenerateEncoderDecoderOutput if ft.is_encoder_decoder else GenerateDecoderOnlyOutput
            return cls(sequences=seq)
        return seq


def dflash_custom_generate(
    draft,
    generator: torch.Generator | None = None,
    draft_cuda_graph: bool | None = None,
    verify_cuda_graph: bool | None = None,
    tree_budget: int | None = None,
    options: DecodeOptions | None = None,
) -> DFlashCustomGenerate:
    """The `custom_generate=` callable for `target.generate` that decodes with `draft` (any target family)."""
    return DFlashCustomGenerate(
        draft,
        generator=generator,
        draft_cuda_graph=draft_cuda_graph,
        verify_cuda_graph=verify_cuda_graph,
        tree_budget=tree_budget,
        options=options,
    )
