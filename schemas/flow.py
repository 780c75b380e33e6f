"""The data-flow picture, drawn from the topic catalog (``schemas/topics.py``).

Every ``TopicSpec`` names who produces and who consumes it; this module turns that into the three
forms the docs carry, so the picture can never drift from the catalog:

- ``flow_text()``: one line per topic, ``producers ──> topic ──> consumers`` (README.md,
  docs/architecture.md);
- ``topic_table()``: the catalog as a Markdown table (docs/architecture.md);
- ``flow_svg()``: the same flow as an SVG drawn in plain Python, deterministic byte for byte
  (docs/img/data-flow.svg).

Pure functions of the catalog; ``.venv/bin/python -m schemas.flow --write`` (a developer command)
rewrites the committed copies, and tests/docs/test_data_flow.py fails when they differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from html import escape
from itertools import zip_longest
from pathlib import Path

from schemas.topics import CATALOG, DAY_MS, TopicSpec

# Markers around the generated blocks in the Markdown files.
FLOW_BEGIN = "<!-- data-flow: generated from schemas/topics.py by `.venv/bin/python -m schemas.flow --write` -->"
FLOW_END = "<!-- /data-flow -->"
TABLE_BEGIN = "<!-- topic-table: generated from schemas/topics.py by `.venv/bin/python -m schemas.flow --write` -->"
TABLE_END = "<!-- /topic-table -->"
SVG_PATH = "docs/img/data-flow.svg"
# (file, begin marker, end marker, generator) of every generated Markdown block.
MARKDOWN_BLOCKS = (
    ("README.md", FLOW_BEGIN, FLOW_END, "flow_block"),
    ("docs/architecture.md", FLOW_BEGIN, FLOW_END, "flow_block"),
    ("docs/architecture.md", TABLE_BEGIN, TABLE_END, "topic_table"),
)

# Fill colours of the component families (first word of the component's name), then topics.
_FAMILY_COLOURS = {
    "gateway": "#dbeafe",
    "applications": "#f3f4f6",
    "streams": "#dcfce7",
    "inference": "#ffedd5",
    "spark": "#ede9fe",
    "analytics": "#f3f4f6",
    "chatpipe": "#e5e7eb",
}
_TOPIC_COLOUR = "#fef9c3"
_ARROW = "──>"


def _grouped(components: tuple[str, ...]) -> list[str]:
    """Components with their family merged: ("streams intake", "streams record") -> "streams intake/record"."""
    out: list[str] = []
    for name in components:
        family, _, part = name.partition(" ")
        if out and part and out[-1].startswith(family + " ") and out[-1].count(" ") == 1:
            out[-1] += "/" + part
        else:
            out.append(name)
    return out


def _wrap(items: list[str], width: int) -> list[str]:
    lines: list[str] = []
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if lines and len(lines[-1]) + 1 + len(piece) <= width:
            lines[-1] += " " + piece
        else:
            lines.append(piece)
    return lines or ["-"]


def flow_text(catalog: Iterable[TopicSpec] = CATALOG, width: int = 32, right: int = 40) -> str:
    """``producers ──> topic ──> consumers``, one row per topic, the lists wrapped at ``width`` / ``right``."""
    specs = list(catalog)
    w_topic = max(len(s.name) for s in specs)
    lines: list[str] = []
    for s in specs:
        prods, cons = _wrap(_grouped(s.producers), width), _wrap(_grouped(s.consumers), right)
        for i, (p, c) in enumerate(zip_longest(prods, cons, fillvalue="")):
            if i == 0:
                lines.append(f"{p:>{width}} {_ARROW} {s.name:<{w_topic}} {_ARROW} {c}".rstrip())
            else:
                lines.append(f"{p:>{width}}     {'':<{w_topic}}     {c}".rstrip())
    return "\n".join(lines) + "\n"


def flow_block(catalog: Iterable[TopicSpec] = CATALOG) -> str:
    """The text form as a fenced Markdown block (what sits between the data-flow markers)."""
    return "```\n" + flow_text(catalog) + "```\n"


def _retention(ms: int) -> str:
    if ms < 0:
        return "forever"
    if ms % DAY_MS == 0:
        return f"{ms // DAY_MS} d"
    if ms % 3_600_000 == 0:
        return f"{ms // 3_600_000} h"
    return f"{ms} ms"


def topic_table(catalog: Iterable[TopicSpec] = CATALOG) -> str:
    """The catalog as a Markdown table, with who produces and who consumes each topic."""
    lines = ["| topic | partitions | key | value | cleanup | retention | produced by | consumed by |",
             "|---|---|---|---|---|---|---|---|"]
    for s in catalog:
        lines.append(f"| `{s.name}` | {s.partitions} | {s.key} | {s.value} | {s.cleanup_policy} | "
                     f"{_retention(s.retention_ms)} | {', '.join(s.producers) or '-'} | "
                     f"{', '.join(s.consumers) or '-'} |")
    return "\n".join(lines) + "\n"


def flow_svg(catalog: Iterable[TopicSpec] = CATALOG) -> str:
    """The flow as an SVG: one band per topic, producers on the left, consumers on the right."""
    specs = list(catalog)
    box_h, gap, band_gap = 22, 4, 14
    x_prod, w_prod = 16, 190
    x_topic, w_topic = 290, 300
    x_cons, w_cons = 674, 190
    width = x_cons + w_cons + 16
    top = 58
    out: list[str] = []

    def box(x: float, y: float, w: float, h: float, fill: str, text: str, small: str = "") -> None:
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="4" fill="{fill}" stroke="#6b7280"/>')
        if small:
            out.append(f'<text x="{x + w / 2}" y="{y + h / 2 - 3}" class="t">{escape(text)}</text>')
            out.append(f'<text x="{x + w / 2}" y="{y + h / 2 + 10}" class="s">{escape(small)}</text>')
        else:
            out.append(f'<text x="{x + w / 2}" y="{y + h / 2 + 4}" class="c">{escape(text)}</text>')

    def arrow(x1: float, y1: float, x2: float, y2: float) -> None:
        out.append(f'<path d="M{x1},{y1} C{(x1 + x2) / 2},{y1} {(x1 + x2) / 2},{y2} {x2},{y2}" '
                   f'class="a" marker-end="url(#arrow)"/>')

    y = top
    for s in specs:
        n = max(len(s.producers), len(s.consumers), 2)
        band_h = n * box_h + (n - 1) * gap
        topic_y = y + (band_h - 34) / 2
        box(x_topic, topic_y, w_topic, 34, _TOPIC_COLOUR, s.name,
            f"{s.value} · {s.partitions} partition{'s' if s.partitions != 1 else ''} · key {s.key}")
        mid = topic_y + 17
        for side, names, x, w in (("p", s.producers, x_prod, w_prod), ("c", s.consumers, x_cons, w_cons)):
            k = len(names)
            first = y + (band_h - (k * box_h + (k - 1) * gap)) / 2
            for i, name in enumerate(names):
                by = first + i * (box_h + gap)
                box(x, by, w, box_h, _FAMILY_COLOURS.get(name.split()[0], "#ffffff"), name)
                if side == "p":
                    arrow(x + w, by + box_h / 2, x_topic - 2, mid)
                else:
                    arrow(x_topic + w_topic, mid, x - 2, by + box_h / 2)
        y += band_h + band_gap
        out.append(f'<line x1="8" y1="{y - band_gap / 2}" x2="{width - 8}" y2="{y - band_gap / 2}" class="sep"/>')
    height = y + 8
    head = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
        "<desc>Generated from schemas/topics.py by: .venv/bin/python -m schemas.flow --write (do not edit)</desc>",
        "<style>.t{font-size:13px;font-weight:bold;text-anchor:middle}.s{font-size:10px;fill:#4b5563;"
        "text-anchor:middle}.c{font-size:12px;text-anchor:middle}.h{font-size:13px;font-weight:bold;"
        "text-anchor:middle;fill:#374151}.a{fill:none;stroke:#6b7280;stroke-width:1.2}"
        ".sep{stroke:#e5e7eb;stroke-width:1}</style>",
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#6b7280"/></marker></defs>',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{x_prod + w_prod / 2}" y="24" class="h">produced by</text>',
        f'<text x="{x_topic + w_topic / 2}" y="24" class="h">Kafka topic (record · partitions · key)</text>',
        f'<text x="{x_cons + w_cons / 2}" y="24" class="h">consumed by</text>',
        f'<line x1="8" y1="{top - 14}" x2="{width - 8}" y2="{top - 14}" class="sep"/>',
    ]
    return "\n".join([*head, *out, "</svg>"]) + "\n"


def replace_block(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with what lies between the ``begin`` and ``end`` marker lines replaced by ``body``."""
    try:
        head, rest = text.split(begin + "\n", 1)
        _, tail = rest.split(end, 1)
    except ValueError:
        raise ValueError(f"markers {begin!r} ... {end!r} not found") from None
    return f"{head}{begin}\n{body}{end}{tail}"


def expected_files(root: Path) -> dict[Path, str]:
    """Every generated file's path under ``root`` and the content the catalog gives it."""
    files: dict[Path, str] = {root / SVG_PATH: flow_svg()}
    for name, begin, end, generator in MARKDOWN_BLOCKS:
        path = root / name
        current = files.get(path, path.read_text(encoding="utf-8"))
        files[path] = replace_block(current, begin, end, globals()[generator]())
    return files


def main(argv: list[str] | None = None) -> int:
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args == ["--write"]:
        root = Path(__file__).resolve().parent.parent
        for path, content in expected_files(root).items():
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_text(encoding="utf-8") != content:
                path.write_text(content, encoding="utf-8")
                print(f"wrote {path.relative_to(root)}")
        return 0
    if args in ([], ["--text"], ["--svg"]):
        sys.stdout.write(flow_svg() if args == ["--svg"] else flow_text())
        return 0
    print("usage: python -m schemas.flow [--text | --svg | --write]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
