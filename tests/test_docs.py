"""The docs hold together: every relative link and anchor resolves, docs/environment.md's table
names exactly the HVDTRAIN_* variables the code reads, and the site (mkdocs.yml) builds without a
warning. Pure Python, no TensorFlow."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: A markdown link or image: [text](target), the target up to a space or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
VARIABLE = re.compile(r"\bHVDTRAIN_[A-Z0-9]+(?:_[A-Z0-9]+)*")

#: Where the code that reads variables lives (tests/ is read separately, below).
CODE = ["hvdtrain", "scripts", "slurm", "containers", "benchmarks", "examples", "Makefile", ".ci"]
#: Names in the code that are not environment variables.
NOT_VARIABLES = {
    "HVDTRAIN_PROBE": "the marker that starts the launcher's probe's answer on stdout",
    "HVDTRAIN_CUDA_FROM_WHEELS": "a line scripts/gpu_toolchain.py prints for install.sh to read",
}
#: Variables only the tests and their cluster scripts read: not for users, so not in the table.
TEST_ONLY = {
    # The local clusters' scripts under tests/cluster/ (their headers list these knobs).
    "HVDTRAIN_CLUSTER": "prefix of the namespace cluster's knobs",
    "HVDTRAIN_CLUSTER_DIR": "the namespace cluster's state directory",
    "HVDTRAIN_CLUSTER_TIMEOUT": "the namespace cluster's wait for its daemons",
    "HVDTRAIN_SLURM": "prefix of the one-node Slurm's knobs",
    "HVDTRAIN_SLURM_DIR": "the one-node Slurm's state directory",
    "HVDTRAIN_SLURM_TIMEOUT": "the one-node Slurm's wait for its daemons",
    "HVDTRAIN_TEST_RECORD": "where tests/test_cache.py's model records what it trained on",
    "HVDTRAIN_TEST_KILL_AT": "after which step tests/scripts/killed_at_step.py SIGKILLs rank 0",
    "HVDTRAIN_TEST_STALL_AFTER": "when tests/scripts/stalling_model.py stalls",
    "HVDTRAIN_TEST_STALL_RANK": "which rank tests/scripts/stalling_model.py stalls",
    "HVDTRAIN_TEST_TAG": "marks the processes of one test so that it can find what is left",
    "HVDTRAIN_PROBE_VARIABLE": "shows that a user's variable reaches the ranks on every node",
}


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: markup dropped, lowercase, punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``, with GitHub's -1, -2 ... for repeated headings."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else HEADING.match(line)
        if match:
            anchor = github_anchor(match.group(2))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def links(path: Path) -> list[str]:
    """The link targets of ``path``, outside code blocks and code spans."""
    targets, in_code = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            targets += LINK.findall(re.sub(r"`[^`]*`", "", line))
    return targets


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(doc):
    broken = []
    for target in links(doc):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:: not ours to check
            continue
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(REPO)}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in "
                          f"{linked.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_github_anchors_drop_markup_and_punctuation():
    assert github_anchor("A lost node (`--min-nodes`)") == "a-lost-node---min-nodes"
    assert github_anchor("Stopping a job: signals and exit statuses") == \
        "stopping-a-job-signals-and-exit-statuses"
    assert github_anchor("8. Keras 3 against Keras 2 (target ≥ 0.95)") == \
        "8-keras-3-against-keras-2-target--095"


def test_the_site_builds_without_a_warning(tmp_path):
    """`make docs`'s build: every docs page in the menu, and every link and anchor resolving on the
    site as it does on GitHub (mkdocs.yml's validation turns each miss into a warning)."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed; scripts/install.sh installs it")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                            "--site-dir", str(tmp_path / "site")],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    complaints = [line for line in build.stderr.splitlines() if not line.startswith("INFO")]
    assert build.returncode == 0 and not complaints, build.stderr


def names_in(paths: list[Path]) -> dict[str, set[str]]:
    """Each HVDTRAIN_* name in the text files under ``paths`` -> the files that hold it."""
    found: dict[str, set[str]] = {}
    for top in paths:
        for path in [top] if top.is_file() else sorted(top.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for name in VARIABLE.findall(text):
                found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def environment_table() -> set[str]:
    """The variables docs/environment.md's table has a row for."""
    text = (REPO / "docs" / "environment.md").read_text()
    return set(re.findall(r"^\| `(HVDTRAIN_[A-Z0-9_]+)` \|", text, flags=re.MULTILINE))


def test_the_environment_table_names_every_variable_the_code_reads_and_no_other():
    in_code = set(names_in([REPO / name for name in CODE])) - set(NOT_VARIABLES)
    in_table = environment_table()
    missing, stale = sorted(in_code - in_table), sorted(in_table - in_code)
    assert not missing and not stale, (f"read by the code but missing from docs/environment.md: "
                                       f"{missing}; in the table but read nowhere: {stale}")


def test_variables_left_out_of_the_table_are_only_in_the_tests_or_not_variables():
    in_tests = names_in([REPO / "tests"])
    in_code = names_in([REPO / name for name in CODE])
    unexplained = set(in_tests) - set(in_code) - set(TEST_ONLY)
    assert not unexplained, (f"variables only the tests read, neither in docs/environment.md nor "
                             f"in TEST_ONLY with a reason: {sorted(unexplained)}")
    leaked = {name: sorted(in_code[name]) for name in TEST_ONLY if name in in_code}
    assert not leaked, f"TEST_ONLY variables the code reads (give them a row instead): {leaked}"
    gone = {name for name in {**TEST_ONLY, **NOT_VARIABLES}
            if name not in in_tests and name not in in_code}
    assert not gone, f"excluded names that nothing mentions any more: {sorted(gone)}"
