"""Modules and import arrows (module -> module) inside kvcache_exporter, from its `import`
statements (ast, not executed), and the arrows into `cli` from anything but `__main__`.

    .venv/bin/python scripts/import_graph.py [exporter]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def arrows(mods: dict[str, Path]) -> set[tuple[str, str]]:
    """`from .x import y` points at x.y when that is a module, else at x; `import a.b` at a.b."""
    out = set()
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    out.add((name, target))
    return out


def main(folder: str = "exporter") -> None:
    mods = modules(Path(folder) / "kvcache_exporter")
    graph = arrows(mods)
    into_cli = sorted(a for a, b in graph if b == "kvcache_exporter.cli" and a != "kvcache_exporter.__main__")
    print(f"modules/arrows {len(mods)}/{len(graph)}; arrows into cli from below: {len(into_cli)} {into_cli}")


if __name__ == "__main__":
    main(*sys.argv[1:])
