"""The suites of `bench --suite`, run as a user runs them (`python -m`, fresh process).

The cheaper suites run at their `--quick` sizes in one interpreter; the others (xla,
build_time), each of whose points takes a fresh interpreter of its own, are checked for their
options and their committed pages. Nothing here judges a time; memory only where the
allocator counts it surely ('memory' against plain on a chain and a residual CNN).
"""

import re

import pytest

from memory_saving_gradients.cli import options, suites
from memory_saving_gradients.cli.main import main
from memory_saving_gradients.cli.suites.page import COMMAND
from tests.helpers import ROOT, run_python

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HEADER = ("machine", "GPU", "Python", "TensorFlow", "Keras", "memory_saving_gradients", "date")
#: Suites run here, at their quick sizes: the others take a fresh interpreter for every point.
RUN = ("chain", "predictions", "determinism", "fit")


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    stdout = run_python(
        "-m", "memory_saving_gradients", "bench", "--suite", *RUN, "--quick",
        "--results", str(results),
    )  # fmt: skip
    return stdout, results


def tables(page: str) -> list[list[dict[str, str]]]:
    """Each markdown table of `page`, as rows of cells by their column's header."""
    found, lines = [], page.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| ") and (i == 0 or not lines[i - 1].startswith("|")):
            header = [cell.strip() for cell in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                cells = [cell.strip() for cell in row.strip("|").split("|")]
                rows.append(dict(zip(header, cells, strict=True)))
            found.append(rows)
    return found


def ratio(cell: str) -> float:
    """A ratio cell ('0.45', '1.23x') as a number."""
    return float(cell.removesuffix("x"))


def check_header(page: str, name: str, quick: bool) -> None:
    assert f"{COMMAND} {name}{' --quick' if quick else ''}\n" in page
    for field in HEADER:
        assert re.search(rf"^- \*\*{field}:\*\* \S", page, re.MULTILINE), field
    assert re.search(r"^- \*\*date:\*\* \d{4}-\d\d-\d\d \d\d:\d\d UTC$", page, re.MULTILINE)


@pytest.mark.parametrize("name", RUN)
def test_a_quick_suite_writes_its_page_with_where_and_when(pages, name):
    stdout, results = pages
    page = (results / f"{name}.md").read_text()
    assert f"wrote {results / name}.md" in stdout
    check_header(page, name, quick=True)
    assert tables(page), page


def test_the_chain_suite_measures_ratios_to_plain_and_draws_them(pages):
    _, results = pages
    sweep, frontier = tables((results / "chain.md").read_text())
    for row in [*sweep, *frontier]:
        for cell in list(row.values())[2:]:
            if cell:
                assert ratio(cell.split(" (")[0]) > 0, row
    deepest = sweep[-1]
    assert ratio(deepest["'memory'"].split(" (")[0]) < 0.9, deepest
    assert [row["method"] for row in frontier][:3] == ["plain", "'memory'", "'balanced'"]
    assert any(row["method"].startswith("MemoryBudget(") for row in frontier)
    pytest.importorskip("matplotlib")
    for plot in ("chain-depth.png", "chain-frontier.png"):
        assert (results / plot).read_bytes()[:8] == PNG_SIGNATURE


def test_the_predictions_suite_sets_predicted_beside_measured(pages):
    _, results = pages
    (rows,) = tables((results / "predictions.md").read_text())
    assert [row["method"] for row in rows] == ["plain", "'memory'"]
    for row in rows:
        assert float(row["measured MiB"]) > 0 and float(row["static MiB"]) > 0
        ratio(row["time / plain"])


def test_the_determinism_suite_gives_each_configurations_spread(pages):
    _, results = pages
    configurations, alive = tables((results / "determinism.md").read_text())
    assert configurations[0]["configuration"] == "plain"
    for row in configurations:
        assert ratio(row["worst / best"]) >= 1.0
        ratio(row["time / plain"])
    assert alive


def test_the_fit_suite_measures_each_method_alone_and_after_the_others(pages):
    _, results = pages
    (rows,) = tables((results / "fit.md").read_text())
    assert [row["method"] for row in rows] == ["plain", "'speed'", "'memory'"]
    plain = float(rows[0]["MiB"])
    for row in rows:
        assert 0 < float(row["MiB"]) < 1.5 * plain
        # both columns are rounded: MiB to 0.1, the ratio to 0.01
        assert float(row["/ plain"]) == pytest.approx(float(row["MiB"]) / plain, abs=0.02)
        ratio(row["shared / plain"])
        low, high = (ratio(end) for end in row["middle half"].removesuffix("x").split("-"))
        assert low <= ratio(row["time / plain"]) <= high
    assert float(rows[-1]["predicted"]) < 1.0
    pytest.importorskip("matplotlib")
    assert (results / "fit-residual.png").read_bytes()[:8] == PNG_SIGNATURE


def test_every_suite_is_offered_and_has_a_committed_page():
    args = options.parser().parse_args(["bench", "--suite", *suites.SUITES, "--quick"])
    assert args.suite == list(suites.SUITES) and args.quick
    for name in suites.SUITES:
        page = (ROOT / "docs" / "results" / f"{name}.md").read_text()
        check_header(page, name, quick=False)
        assert tables(page), name


@pytest.mark.parametrize(
    ("arguments", "option"),
    [
        (["bench", "--suite", "chain", "--model", "resnet"], "--model"),
        (["bench", "--suite", "fit", "--depths", "4"], "--depths"),
        (["bench", "--quick"], "--quick"),
        (["bench", "--suite", "no-such-suite"], "--suite"),
    ],
)
def test_a_suite_refuses_options_it_does_not_take(arguments, option, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(arguments)
    assert stopped.value.code != 0
    assert f"argument {option}:" in capsys.readouterr().err
