"""Serving DFlash drafts in inference engines (the serving environment: README, "Serve the draft").

- :mod:`dflash_hf.serving.vllm_plugin`: the `vllm.general_plugins` entry point. It registers, under the
  architecture names of the audio LLMs vLLM serves without its hidden-state interface (Qwen2-Audio, Voxtral, ...),
  variants that implement it (:mod:`dflash_hf.serving.vllm_models`), so vLLM serves their DFlash drafts.
- :mod:`dflash_hf.serving.checkpoint_layout`: the weight names vLLM's classes of these families read, the renaming
  the variants apply to the layout transformers 5.17 to 5.22 save, and `rewrite_for_vllm`, the same renaming applied
  to a saved checkpoint on disk.

Importing `dflash_hf` never imports vLLM: the plugin imports it when vLLM loads the plugin, the variants when vLLM
builds one.
"""
