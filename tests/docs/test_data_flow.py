"""The data-flow picture and the topic table in the docs are what the topic catalog generates.

docs/img/data-flow.svg, the text form in README.md and docs/architecture.md and the topic table in
docs/architecture.md are drawn by schemas/flow.py from ``schemas.topics.CATALOG`` (each topic's
producers and consumers). Change the catalog, then regenerate with
``.venv/bin/python -m schemas.flow --write``.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from schemas import flow
from schemas.topics import CATALOG

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "regenerate with: .venv/bin/python -m schemas.flow --write"


def test_the_committed_picture_and_text_are_what_the_catalog_generates():
    stale = []
    for path, content in flow.expected_files(ROOT).items():
        if not path.exists() or path.read_text(encoding="utf-8") != content:
            stale.append(str(path.relative_to(ROOT)))
    assert not stale, f"out of step with schemas/topics.py: {', '.join(stale)}; {REGENERATE}"


def test_every_generated_block_is_in_its_file():
    for name, begin, end, _ in flow.MARKDOWN_BLOCKS:
        text = (ROOT / name).read_text(encoding="utf-8")
        assert begin + "\n" in text and end in text, \
            f"{name} lost its generated block (markers {begin!r} ... {end!r}); {REGENERATE}"


def test_the_readme_shows_the_picture():
    assert f"]({flow.SVG_PATH})" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_topic_names_who_produces_and_who_consumes_it():
    for spec in CATALOG:
        assert spec.producers and spec.consumers, f"{spec.name}: producers and consumers must be named"
        assert len(set(spec.producers)) == len(spec.producers) and len(set(spec.consumers)) == len(spec.consumers)


def test_the_svg_is_well_formed_deterministic_and_names_every_topic_and_component():
    svg = flow.flow_svg()
    assert svg == flow.flow_svg()
    root = ET.fromstring(svg.split("\n", 1)[1])  # after the XML declaration
    texts = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")}
    for spec in CATALOG:
        assert spec.name in texts
        assert set(spec.producers) | set(spec.consumers) <= texts


def test_the_text_form_has_one_row_per_topic():
    text = flow.flow_text()
    for spec in CATALOG:
        assert len(re.findall(rf"──> {re.escape(spec.name)} +──>", text)) == 1, spec.name


def test_replace_block_keeps_what_is_around_the_markers():
    text = f"before\n{flow.FLOW_BEGIN}\nold\n{flow.FLOW_END}\nafter\n"
    assert flow.replace_block(text, flow.FLOW_BEGIN, flow.FLOW_END, "new\n") == \
        f"before\n{flow.FLOW_BEGIN}\nnew\n{flow.FLOW_END}\nafter\n"
