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

#: Old path -> new path, both under the package. (`patch` is left out: that name is the
#: public function `patch`, which importing a module of that name would replace.)
MOVED = {
    "captures": "rewriting.enclosing",
    "costs": "analysis.costs",
    "editor": "rewriting.editor",
    "footprint": "planning.simulation",
    "footprint.ledger": "planning.simulation.ledger",
    "footprint.numbering": "planning.simulation.numbering",
    "footprint.peaks": "planning.simulation.peaks",
    "footprint.simulator": "planning.simulation.simulator",
    "gates": "rewriting.gates",
    "graph": "analysis.queries",
    "inputs": "analysis.arguments",
    "planner": "planning.cut_search",
    "plans": "planning.plans",
    "policies": "planning.policies",
    "rewrite": "rewriting.backprop",
    "schedule": "planning.schedule",
    "search": "planning.search",
    "strategies": "planning.policies",
    "tape": "integrations.tape",
    "tunables": "planning.tunables",
    "view": "analysis.view",
}


class _MovedPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `MOVED` and loads each as the module at its new path."""

    def find_spec(self, fullname: str, path=None, target=None):
        if _old_path(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module) -> None:
        new = f"{PACKAGE}.{MOVED[module.__name__[len(PACKAGE) + 1 :]]}"
        warnings.warn(
            f"{module.__name__} has moved to {new}: import it from there, or use the public "
            f"names of {PACKAGE} (`import {PACKAGE} as msg`).",
            DeprecationWarning,
            stacklevel=_importer_stacklevel(),
        )
        sys.modules[module.__name__] = importlib.import_module(new)


def _old_path(fullname: str) -> str | None:
    """The key of `MOVED` that `fullname` names, or None."""
    prefix = PACKAGE + "."
    if fullname.startswith(prefix) and fullname[len(prefix) :] in MOVED:
        return fullname[len(prefix) :]
    return None


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
