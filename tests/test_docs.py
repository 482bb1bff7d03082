"""The docs: the site builds in strict mode, and every code sample runs.

- `mkdocs build --strict` fails on a broken link, a missing page or anchor, and a
  `::: memory_saving_gradients.x` reference that resolves to nothing.
- Every ```python block of README.md and of the pages under docs/ runs: a page's blocks in
  order, in one namespace, in a fresh interpreter (so a page's global settings, such as a
  mixed-precision policy or TF1 behaviour, stay its own). A block that cannot run on a CPU
  (several GPUs, a cluster) is marked by `<!-- not run -->` on the line before its fence.
- The API reference names every public name, and README's test command is the one CI runs.

The pages' interpreters and the build run two at a time: most of each is importing
TensorFlow and tracing small steps, which a second core halves.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

import memory_saving_gradients as msg

ROOT = Path(__file__).resolve().parent.parent
NOT_RUN = "<!-- not run -->"
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
TIMEOUT_S = 300

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)

#: Runs the blocks in a JSON file ([[label, code], ...]) in order, in one namespace.
_RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for label, code in json.load(open(sys.argv[1])):
    exec(compile(code, label, "exec"), namespace)
"""


def python_blocks(page: Path) -> list[tuple[str, str]]:
    """The page's runnable ```python blocks, each as (page:line, code)."""
    text = page.read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        before = text[: match.start()].rstrip().splitlines()
        if before and before[-1].strip() == NOT_RUN:
            continue
        line = text.count("\n", 0, match.start()) + 2
        blocks.append((f"{page.relative_to(ROOT)}:{line}", match.group(2)))
    return blocks


RUNNABLE = [page for page in PAGES if python_blocks(page)]


def _run_page(page: Path, scratch: Path) -> subprocess.CompletedProcess:
    blocks = scratch / f"{page.relative_to(ROOT).as_posix().replace('/', '_')}.json"
    blocks.write_text(json.dumps(python_blocks(page)))
    workdir = scratch / blocks.stem
    workdir.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    return subprocess.run(
        [sys.executable, "-c", _RUNNER, str(blocks)],
        cwd=workdir,  # files a sample writes (logs, plots) land here
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _build_site(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Future]:
    """Every page's run and the build, started at once on two workers."""
    scratch = tmp_path_factory.mktemp("docs")
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {"site": pool.submit(_build_site, scratch / "site")}
    # The longest pages first, so that the two workers end together.
    for page in sorted(RUNNABLE, key=lambda page: -sum(len(c) for _, c in python_blocks(page))):
        futures[str(page)] = pool.submit(_run_page, page, scratch)
    yield futures
    pool.shutdown(cancel_futures=True)


def test_site_builds_in_strict_mode(runs):
    result = runs["site"].result()
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda page: str(page.relative_to(ROOT)))
def test_code_blocks_run(runs, page):
    result = runs[str(page)].result()
    assert result.returncode == 0, (
        f"a python block of {page.relative_to(ROOT)} failed (mark one that cannot run on a "
        f"CPU with {NOT_RUN} before its fence):\n{result.stderr[-6000:]}"
    )


def test_readme_quickstarts_run():
    """README's three quickstarts and its 'seeing it work' sample are runnable blocks."""
    assert len(python_blocks(ROOT / "README.md")) >= 4


def test_not_run_only_marks_python_blocks():
    """A `<!-- not run -->` marker stands right before a ```python fence, nowhere else."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.strip() == NOT_RUN:
                following = next((s for s in lines[number + 1 :] if s.strip()), "")
                assert following.startswith("```python"), f"{page.name}:{number + 1}"


def _public_names(module: str) -> list[str]:
    """The public module's `__all__`, read from its source (importing it would load
    TensorFlow)."""
    path = ROOT / "memory_saving_gradients" / f"{module}.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return []


def test_reference_names_every_public_name():
    """Every public name has a `:::` entry (importing the package loads no TensorFlow)."""
    referenced = set(re.findall(r"^::: ([\w.]+)", _reference_text(), re.MULTILINE))
    modules = {"keras", "profiling"}
    expected = {f"memory_saving_gradients.{name}" for name in set(msg.__all__) - modules}
    for module in modules:
        if f"memory_saving_gradients.{module}" not in referenced:  # else it lists its names
            expected |= {f"memory_saving_gradients.{module}.{n}" for n in _public_names(module)}
    assert expected - referenced == set()


def _reference_text() -> str:
    return "\n".join(page.read_text() for page in (ROOT / "docs" / "reference").glob("*.md"))


def test_layout_lists_every_module():
    """The package layout page names every module of the package."""
    layout = (ROOT / "docs" / "internals" / "layout.md").read_text()
    package = ROOT / "memory_saving_gradients"
    missing = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if f" {path.name} " not in layout.replace("\n", " \n") and path.name != "__init__.py"
    ]
    assert missing == []


def test_readme_links_resolve():
    """README is read on GitHub, outside the site: its relative links name files that exist."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    relative = [link for link in links if "://" not in link]
    assert relative, "README links to the docs"
    assert [link for link in relative if not (ROOT / link).exists()] == []


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in readme.splitlines()
