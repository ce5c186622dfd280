"""A lineage graph drawn on the server as SVG: no client library, readable without script.

Layout is layered: a node's column is the length of the longest path reaching it (sources
at the left), nodes in a column are stacked in a stable order, edges are curves from the
right side of the source to the left side of the target. Pure: nodes and edges in, markup
out.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

NODE_W, NODE_H = 190, 40
COL_GAP, ROW_GAP = 70, 18
PAD = 12

COLOURS = {  # fill, stroke per artifact type
    "dataset_version": ("#e8eeff", "#2f55d4"),
    "run": ("#e3f4ea", "#17744a"),
    "checkpoint": ("#fff4dc", "#8a5a00"),
    "environment_version": ("#f3e8ff", "#6b3fa0"),
}


@dataclass(frozen=True)
class Node:
    key: tuple[str, str]  # (artifact type, id)
    label: str
    sublabel: str = ""
    href: str = ""
    current: bool = False


@dataclass(frozen=True)
class Edge:
    source: tuple[str, str]
    target: tuple[str, str]
    relation: str


def layers(nodes: list[Node], edges: list[Edge]) -> dict[tuple[str, str], int]:
    """Column of each node: longest path from a source (cycles, which lineage should never
    have, are cut by bounding the relaxation)."""
    column = {n.key: 0 for n in nodes}
    for _ in range(len(nodes)):
        changed = False
        for e in edges:
            if e.source in column and e.target in column and column[e.target] <= column[e.source]:
                column[e.target] = column[e.source] + 1
                changed = True
        if not changed:
            break
    return column


def positions(nodes: list[Node], edges: list[Edge]) -> dict[tuple[str, str], tuple[int, int]]:
    column = layers(nodes, edges)
    rows: dict[int, int] = {}
    placed = {}
    for node in sorted(nodes, key=lambda n: (column[n.key], n.key[0], n.label, n.key[1])):
        col = column[node.key]
        row = rows.get(col, 0)
        rows[col] = row + 1
        placed[node.key] = (PAD + col * (NODE_W + COL_GAP), PAD + row * (NODE_H + ROW_GAP))
    return placed


def render(nodes: list[Node], edges: list[Edge], *, title: str) -> str:
    """The graph as an inline ``<svg>`` element (an empty string when there are no nodes)."""
    if not nodes:
        return ""
    at = positions(nodes, edges)
    width = max(x for x, _ in at.values()) + NODE_W + PAD
    height = max(y for _, y in at.values()) + NODE_H + PAD
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="lineage-graph" role="img" '
        f'aria-labelledby="lineage-title" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        f'<title id="lineage-title">{escape(title)}</title>',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        'fill="#7a8294"/></marker></defs>',
    ]
    for e in edges:
        if e.source not in at or e.target not in at:
            continue
        (x1, y1), (x2, y2) = at[e.source], at[e.target]
        sx, sy, tx, ty = x1 + NODE_W, y1 + NODE_H // 2, x2, y2 + NODE_H // 2
        mid = (sx + tx) // 2
        out.append(
            f'<g class="edge" data-relation="{escape(e.relation)}">'
            f'<path d="M{sx},{sy} C{mid},{sy} {mid},{ty} {tx - 2},{ty}" fill="none" '
            f'stroke="#7a8294" stroke-width="1.5" marker-end="url(#arrow)"/>'
            f'<text x="{mid}" y="{(sy + ty) // 2 - 4}" text-anchor="middle" font-size="10" '
            f'fill="#5b6474">{escape(e.relation)}</text></g>'
        )
    for node in sorted(nodes, key=lambda n: n.key):
        x, y = at[node.key]
        fill, stroke = COLOURS.get(node.key[0], ("#eef0f4", "#5b6474"))
        width_px = 3 if node.current else 1.2
        body = (
            f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="6" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="{width_px}"/>'
            f'<text x="{x + 10}" y="{y + 17}" font-size="12" font-weight="600" '
            f'fill="#1b2130">{escape(_clip(node.label, 26))}</text>'
            f'<text x="{x + 10}" y="{y + 32}" font-size="10" fill="#5b6474">'
            f'{escape(_clip(node.sublabel, 32))}</text>'
        )
        kind, ident = node.key
        attrs = (f'class="node{" current" if node.current else ""}" data-type="{escape(kind)}" '
                 f'data-id="{escape(ident)}"')
        tip = f"<title>{escape(node.label)} — {escape(kind)} {escape(ident)}</title>"
        if node.href:
            out.append(f'<a href="{escape(node.href)}" {attrs}>{tip}{body}</a>')
        else:
            out.append(f"<g {attrs}>{tip}{body}</g>")
    out.append("</svg>")
    return "".join(out)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
