"""The layout's one rule: imports run one way, cli -> serve -> inference / training / interop -> ... -> config.

Every `import aiayn.X` in the package, at the top of a file or inside a function, goes from a part to
one of the same or a lower layer, and no two parts import each other (directly or through others).
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aiayn"
LAYERS = {
    "config": 0, "tokenization": 0, "rundir": 0,
    "nn": 1, "reference": 1, "data": 1, "weights": 1,
    "backends": 2, "io": 2, "aiayn": 2,  # "aiayn": the package's own __init__ (build_model, load_model)
    "inference": 3, "training": 3, "interop": 3,
    "inspect": 4, "verify": 4, "export": 4,
    "serve": 5,
    "cli": 6, "__main__": 7,
}


def part_imports() -> set[tuple[str, str, str]]:
    """(importing part, imported part, file) for every import of one aiayn part by another."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        is_root = relative.name == "__init__.py" and len(relative.parts) == 1
        part = "aiayn" if is_root else relative.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "aiayn":
                # `from aiayn import reference` imports a part; `from aiayn import __version__` the root
                targets = [alias.name if alias.name in LAYERS else "aiayn" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("aiayn."):
                targets = [node.module.split(".")[1]]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".")[1] for a in node.names if a.name.startswith("aiayn.")]
            else:
                continue
            found.update((part, target, str(relative)) for target in targets if target != part)
    return found


def test_every_part_has_a_layer():
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if not p.name.startswith((".", "_")) or
             p.name == "__main__.py"} - {"assets", "examples", "__pycache__"}
    assert parts <= set(LAYERS), sorted(parts - set(LAYERS))


def test_imports_go_down_or_sideways_never_up():
    upward = [(a, b, f) for a, b, f in part_imports() if LAYERS[b] > LAYERS[a]]
    assert not upward, upward


def test_no_import_circles_between_parts():
    graph: dict[str, set[str]] = {}
    for a, b, _ in part_imports():
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    circles = sorted(part for part in graph if reaches(part, part, {part}))
    assert not circles, circles
