"""The package's own surface: importing it is cheap, and every public name is what it says."""

import subprocess
import sys

import pytest

import memory_saving_gradients as msg
from tests.helpers import ROOT


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_importing_the_package_loads_no_tensorflow():
    result = run_python("import sys, memory_saving_gradients\nprint('tensorflow' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_public_names_are_functions_whatever_is_used_first():
    """`patch` is also a module's name: using `patched` first must not leave the module."""
    result = run_python(
        "import memory_saving_gradients as msg\n"
        "msg.patched\n"
        "assert callable(msg.patch) and callable(msg.unpatch), msg.patch\n"
    )
    assert result.returncode == 0, result.stderr


def test_every_public_name_resolves():
    for name in msg.__all__:
        assert getattr(msg, name) is not None, name
    assert set(msg.__all__) <= set(dir(msg))


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
