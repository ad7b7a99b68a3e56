"""Thin wrapper: ``python scripts/generate_labels.py ...`` == ``dflash-generate-labels ...``."""

from dflash_hf.cli.generate_labels import main

if __name__ == "__main__":
    raise SystemExit(main())
