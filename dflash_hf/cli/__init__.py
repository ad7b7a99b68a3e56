"""Console scripts (thin: parse, call, print): `dflash-train`, `dflash-eval`, `dflash-generate-labels`."""
