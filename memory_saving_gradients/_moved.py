"""Import paths the package has moved away from: each still imports, as the module at its new
path, with a DeprecationWarning that names that path.

One finder at the head of `sys.meta_path` answers for every old path (a submodule of an old
package path included, which the file finders would otherwise load a second time under the
old name): the module it loads replaces itself in `sys.modules` with the module now at the
new path, so both names give one module object (the import system supports that
replacement).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

PACKAGE = "memory_saving_gradients"

#: Old path -> new path, both under the package. A package's entry covers its submodules too
#: (`analysis.view` is `_src.analysis.view`), and a new path that has moved again is followed
#: to where it is now (`view` -> `analysis.view` -> `_src.analysis.view`). (`patch` is left
#: out: that name is the public function `patch`, which importing a module of that name would
#: replace.)
MOVED = {
    "_tf": "_src._tf",
    "analysis": "_src.analysis",
    "api": "_src.api",
    "captures": "rewriting.enclosing",
    "costs": "analysis.costs",
    "editor": "rewriting.editor",
    "footprint": "planning.simulation",
    "gates": "rewriting.gates",
    "graph": "analysis.queries",
    "inputs": "analysis.arguments",
    "integrations": "_src.integrations",
    "models": "_src.models",
    "planner": "planning.cut_search",
    "planning": "_src.planning",
    "plans": "planning.plans",
    "policies": "planning.policies",
    "rewrite": "rewriting.backprop",
    "rewriting": "_src.rewriting",
    "schedule": "planning.schedule",
    "search": "planning.search",
    "sizing": "_src.sizing",
    "strategies": "planning.policies",
    "tape": "integrations.tape",
    "tunables": "planning.tunables",
    "view": "analysis.view",
}


class _MovedPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `MOVED` and loads each as the module at its new path."""

    def find_spec(self, fullname: str, path=None, target=None):
        prefix = PACKAGE + "."
        if not fullname.startswith(prefix) or new_path(fullname[len(prefix) :]) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module) -> None:
        new = f"{PACKAGE}.{new_path(module.__name__[len(PACKAGE) + 1 :])}"
        warnings.warn(
            f"{module.__name__} has moved to {new}: import it from there, or use the public "
            f"names of {PACKAGE} (`import {PACKAGE} as msg`).",
            DeprecationWarning,
            stacklevel=_importer_stacklevel(),
        )
        sys.modules[module.__name__] = importlib.import_module(new)


def new_path(old: str) -> str | None:
    """Where the module at `old` (a path under the package) is now, or None where it has not
    moved: the longest moved package or module that `old` is, or is inside, replaced by its
    new path, until no part of the path has moved."""
    new = old
    while moved := next((p for p in _prefixes(new) if p in MOVED), None):
        new = MOVED[moved] + new[len(moved) :]
    return None if new == old else new


def _prefixes(path: str) -> list[str]:
    """`path`, then the packages it is inside, innermost first: `a.b.c`, `a.b`, `a`."""
    parts = path.split(".")
    return [".".join(parts[:end]) for end in range(len(parts), 0, -1)]


def _importer_stacklevel() -> int:
    """The stack level of the frame that imported the old path, past the import system's
    frames and this module's, so the warning is shown where the import was written."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and (
        frame.f_code.co_filename.startswith("<frozen importlib")
        or frame.f_code.co_filename == __file__
    ):
        frame, level = frame.f_back, level + 1
    return level


def install() -> None:
    """Let the old paths import (once per interpreter)."""
    if not any(isinstance(finder, _MovedPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedPaths())
