"""Every measured number in a table of the docs (README.md, docs/*.md) recomputes from a file.

The stored results in docs/bench keep every repeat; each suite's markdown is regenerated here from
them with the code that wrote it, and must equal the stored .md beside it. Every row of every
measurement table in the docs must then be a row of one of those regenerated tables: a number
typed by hand, or left behind by an older run, fails.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STORED = REPO / "docs" / "bench"
#: Tables that hold no measurement: what the machine is, and figures published elsewhere.
NOT_MEASURED = ("| | |", "| source | setting | reported |")
#: What makes a table outside docs/benchmarks.md a measurement table: a number with a benchmark's
#: unit, or a speedup.
MEASURED_FIGURE = re.compile(r"\d[\d.,]* ?(samples/s|steps/s|GB/s|ms/step|s/step)|\d\.\d+x\b")
#: Every page of the docs; docs/benchmarks.md holds the measurements, the others may quote them.
DOCS = ["README.md", *sorted(str(page.relative_to(REPO)) for page in (REPO / "docs").glob("*.md"))]


def regenerate(stored: Path) -> str:
    """The markdown that the suite which wrote ``stored`` makes of it."""
    from benchmarks import datascale, decode, network, report, resized, startup, threads
    from benchmarks.harness import Comparison

    data = json.loads(stored.read_text())
    if stored.name == "results.json":
        comparisons = [Comparison.from_dict(c) for c in data["comparisons"]]
        return report.markdown(comparisons, data.get("speedup_vs_workers"), data["machine"])
    makers = {"data.json": datascale.markdown, "network.json": network.markdown,
              "threads.json": threads.markdown, "decode.json": decode.markdown,
              "decode-steps.json": decode.steps_markdown, "resized.json": resized.markdown,
              "startup.json": startup.markdown}
    return makers[stored.name](data) + "\n"


def stored_results() -> list[Path]:
    return sorted(STORED.rglob("*.json"))


def tables(text: str) -> list[list[str]]:
    """The markdown tables of ``text`` (outside code blocks), each a list of its lines."""
    found, current, in_code = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("|"):
            current.append(line.rstrip())
            continue
        if current:
            found.append(current)
        current = []
    if current:
        found.append(current)
    return found


def test_every_suite_has_stored_results():
    names = {path.name for path in stored_results()}
    assert {"results.json", "threads.json", "network.json", "data.json", "decode.json"} <= names, \
        names


@pytest.mark.parametrize("stored", stored_results(), ids=lambda p: str(p.relative_to(STORED)))
def test_each_stored_table_is_its_measurements_markdown(stored):
    assert stored.with_suffix(".md").read_text() == regenerate(stored)


def _generated_rows() -> set[str]:
    return {line for stored in stored_results() for table in tables(regenerate(stored))
            for line in table}


@pytest.mark.parametrize("doc", DOCS)
def test_every_measurement_table_row_in_the_docs_recomputes_from_a_stored_file(doc):
    generated = _generated_rows()
    text = (REPO / doc).read_text()
    measurement_tables = [table for table in tables(text) if table[0] not in NOT_MEASURED
                          and (doc == "docs/benchmarks.md" or "measured on" in table[0]
                               or MEASURED_FIGURE.search("".join(table)))]
    if doc == "docs/benchmarks.md":
        assert len(measurement_tables) >= 6, "the page lost its tables"
    missing = [line for table in measurement_tables for line in table if line not in generated]
    assert not missing, (f"{len(missing)} table line(s) of {doc} recompute from no file in "
                         f"docs/bench:\n" + "\n".join(missing[:10]))


def test_the_docs_link_only_to_stored_results_that_exist():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    for target in re.findall(r"\]\((bench/[^)#]+)", text):
        assert (REPO / "docs" / target).exists(), target
