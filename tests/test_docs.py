"""The documentation as a test: the benchmark tables are the results files, the README stays short, every
relative link resolves, the README's numbers are in the results files its lines link to, and its settings
table is the one server/settings.py defines. No model: this runs in about a second."""

import re
from pathlib import Path

import pytest

from benchmarks import tables
from minivllm.config import EVICTION_POLICIES, PUBLICATION_MODES, SINGLE_FLIGHT_MODES
from server.settings import LOG_LEVELS, OPTIONS, Settings

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
README_MAX_LINES = 250

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks (a code sample's brackets are no links)."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def relative_links(line: str) -> list[str]:
    """Link targets of a line that name a file of the repository (no URLs, no bare #anchors)."""
    targets = []
    for target in LINK.findall(line):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


# -- benchmarks/README.md is generated ------------------------------------------------------------------
def test_benchmarks_readme_is_what_the_tables_script_writes():
    assert tables.main(["--check"]) == 0, "run `python -m benchmarks.tables` and commit benchmarks/README.md"


def test_the_check_fails_when_the_benchmarks_readme_drifts(tmp_path):
    current = tables.README.read_text()
    row = re.search(r"\| 10000 \| (0\.\d{4}) \|", current)  # a hit rate in one of the replay tables
    assert row is not None
    other = "0.9999" if row[1] != "0.9999" else "0.0000"
    drifted = tmp_path / "README.md"
    drifted.write_text(current.replace(row[0], row[0].replace(row[1], other), 1))
    assert tables.main(["--check", "--output", str(drifted)]) == 1
    assert tables.main(["--check", "--output", str(tmp_path / "absent.md")]) == 1
    drifted.write_text(current)
    assert tables.main(["--check", "--output", str(drifted)]) == 0


def test_text_written_for_another_commit_stops_the_build(tmp_path):
    template = tmp_path / "template.md"
    template.write_text("# Benchmarks\n\n{{ results/peer.md @ 0000000 }}\n")
    with pytest.raises(tables.TablesError, match="written for 0000000"):
        tables.render(template)
    template.write_text("# Benchmarks\n\n{{ results/no_such_benchmark.md @ 0000000 }}\n")
    with pytest.raises(tables.TablesError, match="does not exist"):
        tables.render(template)


def test_results_from_uncommitted_trees_are_never_quoted():
    dirty = [r for r in map(tables.parse_result, sorted(tables.RESULTS.rglob("*.md"))) if r.dirty]
    text = tables.render()
    for r in dirty:
        lines = r.body.splitlines()
        separators = [i for i, line in enumerate(lines) if line.startswith("|---") or line.startswith("|:")]
        data_rows = [line for i in separators for line in lines[i + 1 :] if line.startswith("| ")]
        assert data_rows and not any(row in text for row in data_rows), r.rel
        assert f"]({r.rel})" in text  # linked, not quoted


def test_every_results_file_and_plot_is_in_the_benchmarks_readme():
    text = tables.README.read_text()
    for path in sorted(tables.RESULTS.rglob("*")):
        if path.suffix in (".md", ".png"):
            assert f"]({path.relative_to(tables.BENCHMARKS).as_posix()})" in text, path


# -- the README ------------------------------------------------------------------------------------------
def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material to docs/"
    assert (
        len([t for line in prose_lines(README) for t in relative_links(line)]) > 10
    )  # the link check sees them


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_points_at_a_file(doc):
    links = [t for line in prose_lines(doc) for t in relative_links(line)]
    missing = sorted({t for t in links if not (doc.parent / t).exists()})
    assert missing == [], f"{doc.relative_to(REPO)}: links to missing files {missing}"


def _without_thousands(text: str) -> str:
    return re.sub(r"(?<=\d),(?=\d{3})", "", text)


def test_readme_numbers_come_from_the_results_files_their_lines_link():
    checked = 0
    for line in prose_lines(README):
        sources = [
            t for t in relative_links(line) if t.startswith("benchmarks/results/") and t.endswith(".md")
        ]
        if not sources:
            continue
        haystack = _without_thousands("\n".join((REPO / s).read_text() for s in sources))
        for number in NUMBER.findall(LINK.sub("", line)):
            n = _without_thousands(number)
            assert re.search(rf"(?<![\d.]){re.escape(n)}(?!\d|\.\d)", haystack), (
                f"README.md: {number} is not in {sources}: {line.strip()[:100]}"
            )
            checked += 1
    assert checked >= 20  # the headline table and the first start, at least


def _settings_rows() -> list[list[str]]:
    lines = README.read_text().split("\n## Settings\n", 1)[1].split("\n## ", 1)[0].splitlines()
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("| `")
    ]
    return rows


def test_the_settings_table_is_the_one_server_settings_defines():
    rows = _settings_rows()
    assert [r[0] for r in rows] == [f"`{o.env}`" for o in OPTIONS]
    choices = {
        "MINIVLLM_EVICTION": EVICTION_POLICIES,
        "MINIVLLM_PUBLICATION": PUBLICATION_MODES,
        "MINIVLLM_SINGLE_FLIGHT": SINGLE_FLIGHT_MODES,
        "MINIVLLM_LOG_LEVEL": LOG_LEVELS,
    }
    engine = Settings.from_env({}).engine_config()
    derived = {"single_flight": engine.single_flight}
    for (_, flag, default, meaning), o in zip(rows, OPTIONS):
        assert flag == f"`{o.flag}`", o.env
        if o.name in derived:  # no default of its own: the engine's, from the other settings
            assert default.startswith(f"`{derived[o.name]}`"), (o.env, default)
        elif o.default is None:
            assert not default.startswith("`"), (o.env, default)  # "—" or words, never a made-up literal
        else:
            shown = ("1" if o.default else "0") if isinstance(o.default, bool) else str(o.default)
            assert default.startswith(f"`{shown}`"), (o.env, default, o.default)
        for choice in choices.get(o.env, ()):
            assert f"`{choice}`" in meaning, (o.env, choice)
