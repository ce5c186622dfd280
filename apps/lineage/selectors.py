from __future__ import annotations

from apps.lineage.models import LineageEdge

MAX_DEPTH = 20


def graph(*, team_id: int, artifact_type: str, artifact_id: str, depth: int = MAX_DEPTH) -> dict:
    """Upstream and downstream edges reachable from one artifact (breadth-first, bounded)."""
    edges: dict[int, LineageEdge] = {}
    for direction in ("upstream", "downstream"):
        frontier = {(artifact_type, artifact_id)}
        seen = set(frontier)
        for _ in range(depth):
            found = []
            for kind, ident in frontier:
                if direction == "upstream":
                    rows = LineageEdge.objects.filter(team_id=team_id, target_type=kind,
                                                      target_id=ident)
                    found += [((e.source_type, e.source_id), e) for e in rows]
                else:
                    rows = LineageEdge.objects.filter(team_id=team_id, source_type=kind,
                                                      source_id=ident)
                    found += [((e.target_type, e.target_id), e) for e in rows]
            frontier = set()
            for node, edge in found:
                edges[edge.pk] = edge
                if node not in seen:
                    seen.add(node)
                    frontier.add(node)
            if not frontier:
                break
    nodes = {(artifact_type, artifact_id)}
    for e in edges.values():
        nodes.add((e.source_type, e.source_id))
        nodes.add((e.target_type, e.target_id))
    return {
        "root": {"type": artifact_type, "id": artifact_id},
        "nodes": [{"type": t, "id": i} for t, i in sorted(nodes)],
        "edges": [
            {"source": {"type": e.source_type, "id": e.source_id},
             "target": {"type": e.target_type, "id": e.target_id},
             "relation": e.relation, "created_at": e.created_at}
            for e in sorted(edges.values(), key=lambda e: e.pk)
        ],
    }
