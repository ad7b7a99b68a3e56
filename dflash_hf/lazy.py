"""Public names of a package imported on first use: a folder's `__init__` names what it exports and from which of
its modules, and importing the folder imports none of them (so `dflash-train --help` loads no torch, and no folder's
`__init__` can make an import circle). Standard library only: every `__init__` may import it."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence

# package -> {public name: the module it is imported from}, for every package that exports lazily
EXPORTED: dict[str, dict[str, str]] = {}


def lazy_exports(
    package: str, exports: Mapping[str, Sequence[str]]
) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """`__all__`, `__getattr__` and `__dir__` for `package` (its `__name__`), whose public names are
    `exports`: module (relative to the package, e.g. ``".speculative"``) -> the names it defines. A name is imported
    from its module the first time it is read, then kept in the package's namespace::

        __all__, __getattr__, __dir__ = lazy_exports(__name__, {".speculative": ["speculative_generate"]})
    """
    sources = {name: module for module, names in exports.items() for name in names}
    if len(sources) != sum(len(names) for names in exports.values()):
        raise ValueError(f"{package}: a name is exported from two modules")
    EXPORTED[package] = {name: importlib.util.resolve_name(module, package) for name, module in sources.items()}

    def __getattr__(name: str) -> object:
        if name not in sources:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(sources[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(sources))

    return sorted(sources), __getattr__, __dir__
