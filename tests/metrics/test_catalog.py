from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from traind.metrics.catalog import BY_NAME, CATALOG, build, markdown

REPO = Path(__file__).resolve().parents[2]


def test_names_follow_prometheus_conventions():
    assert len(BY_NAME) == len(CATALOG), "a name is declared twice"
    for m in CATALOG:
        assert m.name.startswith("traind_"), m.name
        assert not m.name.endswith("_total"), f"{m.name}: counters are declared without _total"
        if m.unit == "seconds":
            assert m.name.endswith("_seconds"), m.name
        if m.unit == "bytes":
            assert "_bytes" in m.name, m.name
        if m.unit == "ratio":
            assert m.name.endswith("_ratio"), m.name
        assert m.help.endswith("."), f"{m.name}: help is a sentence"
        for label in m.labels:
            assert label.isidentifier() and label.islower(), (m.name, label)


def test_every_entry_builds():
    reg = CollectorRegistry()
    for m in CATALOG:
        build(reg, m.name)  # no duplicate or malformed family
    assert isinstance(build(CollectorRegistry(), "traind_train_tokens"), Counter)


def test_docs_page_is_generated_from_the_catalog():
    page = (REPO / "docs" / "metrics.md").read_text()
    assert page == markdown(), "docs/metrics.md is stale: run `traind metrics docs`"
    for m in CATALOG:
        assert f"`{m.exposed}`" in page


def test_every_communication_family_carries_its_mesh_dim():
    # DESIGN.md: dp, tp or pp on every communication figure, so one query splits by it
    comm = [m for m in CATALOG if m.source == "comm"]
    assert comm
    assert all("mesh_dim" in m.labels for m in comm), [m.name for m in comm
                                                        if "mesh_dim" not in m.labels]
