"""The package's own surface: importing it is cheap, and every public name is what it says."""

import ast
import importlib
import re
import subprocess
import sys
import warnings

import pytest

import memory_saving_gradients as msg
from memory_saving_gradients import _moved
from tests.helpers import ROOT


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_importing_the_package_loads_no_tensorflow():
    result = run_python("import sys, memory_saving_gradients\nprint('tensorflow' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_public_names_are_what_they_say_whatever_is_used_first():
    result = run_python(
        "import memory_saving_gradients as msg\n"
        "msg.patched\n"
        "assert callable(msg.patch) and callable(msg.unpatch), msg.patch\n"
        "assert callable(msg.keras.enable), msg.keras\n"
    )
    assert result.returncode == 0, result.stderr


def test_documented_import_paths_import():
    """Each path the README, the docstrings or earlier releases told users to write."""
    result = run_python(
        "import warnings\n"
        "warnings.simplefilter('error')\n"
        "import memory_saving_gradients as msg\n"
        "import memory_saving_gradients.keras\n"
        "from memory_saving_gradients.keras import LayerOutputs, MemoryLog, enable, "
        "layer_outputs\n"
        "assert msg.keras.enable is enable and msg.keras.MemoryLog is MemoryLog\n"
        "assert callable(msg.profiling.peak_memory)\n"
        "from memory_saving_gradients.profiling import measure_costs, peak_memory\n"
        "from memory_saving_gradients import gradients_speed, gradients_memory, patch\n"
        "assert callable(patch)\n"
    )
    assert result.returncode == 0, result.stderr


def _old_paths() -> list[str]:
    """Every path of `_moved.MOVED`, and every module now under `_src` by the path it had
    before (`analysis.view` for `_src.analysis.view`), but those a public module re-exports
    at that path (`profiling`)."""
    package = ROOT / "memory_saving_gradients"
    modules = {
        ".".join(path.relative_to(package / "_src").with_suffix("").parts)
        for path in (package / "_src").rglob("*.py")
    }
    modules = {module.removesuffix(".__init__") for module in modules}
    public = {path.stem for path in package.glob("*.py")}
    return sorted({*_moved.MOVED, *modules} - public)


@pytest.mark.parametrize("old", _old_paths())
def test_moved_paths_import_the_module_at_the_new_path_with_a_warning(old, monkeypatch):
    new = _moved.new_path(old)
    assert new is not None and new.startswith("_src."), new
    if old not in _moved.MOVED:
        assert new == f"_src.{old}"
    name = f"memory_saving_gradients.{old}"
    monkeypatch.delitem(sys.modules, name, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    # One for each moved path imported: the old package of a submodule too.
    assert any(
        m.startswith(f"{name} has moved to memory_saving_gradients.{new}:") for m in messages
    )
    assert len(messages) == len(caught), [str(w.message) for w in caught]
    assert module is importlib.import_module(f"memory_saving_gradients.{new}")


#: The package's layers, and what each may import of it, for type checking too. `_src` holds
#: the implementation, in layers that import only those below (`_tf` is the only module
#: touching TensorFlow's private APIs); the public modules re-export it, and the command
#: (`cli`) sits on top.
MAY_IMPORT = {
    "_src._tf": set(),
    "_src.sizing": set(),
    "_src.models": set(),
    "_src.analysis": {"_src._tf"},
    "_src.profiling": {"_src._tf", "_src.analysis"},
    "_src.planning": {"_src._tf", "_src.analysis"},
    "_src.rewriting": {"_src._tf", "_src.analysis", "_src.planning"},
    "_src.api": {"_src._tf", "_src.analysis", "_src.planning", "_src.rewriting"},
    "_src.integrations": {
        "_src._tf", "_src.analysis", "_src.planning", "_src.rewriting", "_src.api",
        "_src.profiling", "_src.sizing",
    },
    "_moved": set(),
    "__init__": {"_moved"},
    "keras": {"_src.integrations"},
    "profiling": {"_src.profiling"},
    "cli": {"__init__", "keras", "profiling", "_src.models", "_src.planning", "_src.sizing"},
    "__main__": {"cli"},
}  # fmt: skip


def _layer(module: str) -> str:
    """The layer of the package that `module` (a dotted path in it) is in: `_src.analysis`
    for `memory_saving_gradients._src.analysis.view`, `keras` for its `keras`, `__init__`
    for the package itself."""
    parts = module.split(".")[1:]
    return ".".join(parts[:2] if parts[:1] == ["_src"] else parts[:1]) or "__init__"


def _package_imports(path) -> set[str]:
    """The package's layers `path` imports, at run time or for type checking."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {_layer(name) for name in imported if name.split(".")[0] == "memory_saving_gradients"}


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_each_layer_imports_only_the_layers_below_it(layer):
    package = ROOT / "memory_saving_gradients"
    folder = package.joinpath(*layer.split("."))
    paths = sorted(folder.rglob("*.py")) or [folder.with_suffix(".py")]
    for path in paths:
        wrong = _package_imports(path) - MAY_IMPORT[layer] - {layer}
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"


def test_every_public_name_resolves():
    for name in msg.__all__:
        assert getattr(msg, name) is not None, name
    assert set(msg.__all__) <= set(dir(msg))


def test_public_names_carry_their_types_to_type_checkers(tmp_path):
    """`__init__.pyi` lists the public names for mypy and IDEs, loaded lazily as they are:
    a user's wrong argument is an error, not lost in Any."""
    user = tmp_path / "user.py"
    user.write_text(
        "import memory_saving_gradients as msg\n"
        "budget: msg.MemoryBudget = msg.MemoryBudget(0.5)\n"
        "msg.gradients([], [], checkpoints=budget, name=3)\n"
        "msg.plan([], [], checkpoints=1.5)\n"
        "msg.keras.enable(None, measure='yes')\n"
        "msg.profiling.peak_memory(lambda: None, device=0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", str(user)],
        cwd=ROOT,  # mypy finds this checkout's package first
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = re.findall(r"user\.py:(\d+): error", result.stdout)
    assert errors == ["3", "4", "5", "6"], result.stdout + result.stderr


@pytest.mark.parametrize(
    "check",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["mypy"]],
    ids=["ruff", "ruff format", "mypy"],
)
def test_the_code_passes_its_checkers(check):
    """Ruff over the repository and mypy over the package (settings in pyproject.toml)."""
    result = subprocess.run(
        [sys.executable, "-m", *check],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_view_a_policy_is_given_holds_what_policies_choose_from():
    """`ForwardView` is documented as what a policy sees: how the executor runs the step
    around it (what only the rewrite and the simulator use) lives in `Execution`."""
    import dataclasses

    members = {name for name in dir(msg.ForwardView) if not name.startswith("_")}
    members |= {field.name for field in dataclasses.fields(msg.ForwardView)}
    assert members == {
        "ys", "xs", "ops", "recomputable", "must_keep", "reused", "given_grad_ys",
        "gradients_held", "update_scratch", "measured", "enclosing", "build", "costs",
        "weight_ops", "is_weight", "is_x", "bytes", "position", "order", "consumers",
        "kept_for_variable_reads",
    }  # fmt: skip
