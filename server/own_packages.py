"""The project's own top-level packages win over any installed distribution of the same name.

Its packages have generic names (`kernels`, `config`, `models`, `cache`, `bench`), and an
editable install finds them only after site-packages: Hugging Face's `kernels`
distribution (pulled in by transformers >= 5.25) shadowed ours there, and the server
died in an ImportError from inside cache/. `claim()` puts a finder at the front of
sys.meta_path that resolves exactly those names from the folder that holds `server/`,
before any of them is imported (the `server` package imports this first). Where that
cannot be arranged (a foreign package of one of these names already imported), it stops
with one line naming the distribution and the fix, never a traceback from inside.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

# Every top-level package the h2o-server distribution installs (pyproject.toml), `server`
# included: a foreign `server` ahead of ours is met by the console script before this
# runs, but one imported later in the process is still refused here.
TOP_LEVEL = ("config", "models", "kernels", "cache", "server", "bench")
ROOT = Path(__file__).resolve().parent.parent  # the folder holding the project's packages


class ShadowedPackage(SystemExit):
    """A foreign package already holds one of the project's names in this process."""


class _OwnPackages(importlib.abc.MetaPathFinder):
    """Finds the project's top-level packages in ROOT only; everything else passes by."""

    def find_spec(self, name, path=None, target=None):
        if name not in TOP_LEVEL:
            return None
        return importlib.machinery.PathFinder.find_spec(name, [str(ROOT)])


_FINDER = _OwnPackages()


def origin_of(name: str) -> Path | None:
    """Where the project's package `name` lives (None when ROOT lacks it)."""
    spec = _FINDER.find_spec(name)
    return Path(spec.origin).resolve() if spec is not None and spec.origin else None


def shadowing_message(name: str, where: str) -> str:
    """The one line that names a foreign package of one of the project's names, and the fix."""
    dists = packages_distributions().get(name, [])
    owner = f"the {'/'.join(sorted(set(dists)))} distribution" if dists else "another package"
    return (
        f"h2o-server: the module {name!r} was already imported from {owner} ({where}), "
        f"which shadows the project's own {name}/ package in {ROOT}. Import h2o-server's "
        f"packages (`import server`) before anything that imports {name!r}, or run "
        f"h2o-server from its own virtual environment (make setup)."
    )


def claim() -> None:
    """Make every later import of the project's top-level names find the project's own."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    for name in TOP_LEVEL:
        module = sys.modules.get(name)
        if module is None:
            continue
        where = getattr(module, "__file__", None) or str(getattr(module, "__path__", "?"))
        mine = origin_of(name)
        if mine is None or where is None or Path(where).resolve() != mine:
            raise ShadowedPackage(shadowing_message(name, where))
