"""Bootstrap a DFlash2 draft from a DFlash export.

The DFlash weights are copied unchanged; the DFlash2 additions start at their identity init (identity
convolutions, zero successor codebook, N(0, 0.02) predecessor codebook), so the converted draft proposes
exactly what the DFlash draft proposed until it is trained with `variant: dflash2`.

    python scripts/convert_dflash_to_dflash2.py /path/to/dflash-draft /path/to/dflash2-draft
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from dflash_hf.export import convert_dflash_to_dflash2
from dflash_hf.models.configuration_dflash import DFlash2Fields


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="DFlash draft export directory (or a Hub id in the local cache)")
    parser.add_argument("out_dir", help="where the DFlash2 export is written")
    for f in fields(DFlash2Fields):  # defaults and help from the one definition
        parser.add_argument(f"--{f.name}", type=int, default=f.default, help=f.metadata["help"])
    parser.add_argument("--seed", type=int, default=0, help="seed of the predecessor codebook init")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    out = convert_dflash_to_dflash2(
        args.source,
        args.out_dir,
        seed=args.seed,
        **DFlash2Fields.of(args).as_dict(),
    )
    print(f"wrote DFlash2 draft to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
