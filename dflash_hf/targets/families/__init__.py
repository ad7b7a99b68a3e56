"""Target families: what each kind of target needs (its processor call, audio positions, decoder prompt, serving
fields), one `TargetFamily` subclass each, and the registry resolving a config to its family. Public names are
imported on first use (`dflash_hf.lazy`)."""

from dflash_hf.lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".base": ["EncoderDecoderFamily", "TargetFamily", "get_tokenizer"],
        ".registry": [
            "FAMILIES",
            "FAMILY_CLASSES",
            "encode_batch",
            "generate_kwargs",
            "resolve_family",
        ],
    },
)
