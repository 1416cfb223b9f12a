"""The mutation runner's list stays current (the whole run is `python -m tests.mutations`, ~10 minutes):
a mutation whose source text moved no longer breaks anything, so the suite fails until it is updated."""

from pathlib import Path

from tests.mutations import MUTATIONS, REPO, stale_mutations


def test_every_mutation_still_applies_to_the_source_it_breaks():
    assert stale_mutations() == [], "update these mutations' source text in tests/mutations.py"


def test_mutation_names_are_unique_and_their_tests_exist():
    names = [m.name for m in MUTATIONS]
    assert len(set(names)) == len(names)
    for m in MUTATIONS:
        for arg in m.tests:
            if arg.endswith(".py"):
                assert (REPO / arg).is_file(), f"{m.name}: no test file {arg}"


def test_a_moved_source_text_is_reported_stale(tmp_path: Path):
    m = MUTATIONS[0]
    (tmp_path / m.path).parent.mkdir(parents=True)
    (tmp_path / m.path).write_text("# the code it broke has moved\n")
    assert m.name in stale_mutations(tmp_path)
