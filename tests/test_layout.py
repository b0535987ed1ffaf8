"""The layout's one rule: imports run one way, cli -> serve -> inference / training / interop -> ... -> config.

Every `import aiayn.X` in the package, at the top of a file or inside a function, goes from a part to
one of the same or a lower layer, and no two parts import each other (directly or through others); inside
a part too, no module imports one that imports it back (`aiayn.backends`: shapes -> kernels -> calibrate ->
select).
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aiayn"
LAYERS = {
    "config": 0, "tokenization": 0, "rundir": 0, "paths": 0, "memory": 0, "interrupts": 0,
    "tasks.names": 0,  # the objective names alone (it imports nothing), so config and nn may name a head
    "nn": 1, "reference": 1, "data": 1, "weights": 1,
    "backends": 2, "io": 2, "aiayn": 2,  # "aiayn": the package's own __init__ (build_model, load_model)
    "tasks": 3,
    "inference": 4, "training": 4, "interop": 4,
    "inspect": 5, "verify": 5, "export": 5,
    "serve": 6,
    "cli": 7, "__main__": 8,
}
NAMES = "aiayn.tasks.names"
TASKS = PACKAGE / "tasks"


def _part_of(module: str) -> str:
    """The part a dotted `aiayn.X...` module belongs to (`aiayn.tasks.names` is a part of its own)."""
    return "tasks.names" if module == NAMES else module.split(".")[1]


def part_imports() -> set[tuple[str, str, str]]:
    """(importing part, imported part, file) for every import of one aiayn part by another."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        is_root = relative.name == "__init__.py" and len(relative.parts) == 1
        part = "aiayn" if is_root else relative.parts[0].removesuffix(".py")
        if path == TASKS / "names.py":
            part = "tasks.names"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "aiayn":
                # `from aiayn import reference` imports a part; `from aiayn import __version__` the root
                targets = [alias.name if alias.name in LAYERS else "aiayn" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("aiayn."):
                targets = [_part_of(node.module)]
            elif isinstance(node, ast.Import):
                targets = [_part_of(a.name) for a in node.names if a.name.startswith("aiayn.")]
            else:
                continue
            found.update((part, target, str(relative)) for target in targets if target != part)
    return found


def test_every_part_has_a_layer():
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if not p.name.startswith((".", "_")) or
             p.name == "__main__.py"} - {"assets", "examples", "__pycache__"}
    assert parts <= set(LAYERS), sorted(parts - set(LAYERS))


def test_names_module_imports_nothing_of_aiayn():
    """Config and nn import `aiayn.tasks.names`: it must not pull the task objects (which import them) in."""
    tree = ast.parse((TASKS / "names.py").read_text(encoding="utf-8"))
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not imports, [ast.dump(n) for n in imports]
    registry = ast.parse((TASKS / "__init__.py").read_text(encoding="utf-8"))
    eager = {n.module for n in registry.body if isinstance(n, ast.ImportFrom) and n.module.startswith("aiayn")}
    assert eager <= {NAMES, "aiayn.tasks.base"}, eager  # the task files load on first use
    base = ast.parse((TASKS / "base.py").read_text(encoding="utf-8"))
    assert not [n for n in base.body if isinstance(n, ast.ImportFrom) and n.module.startswith("aiayn")]


def test_objective_names_are_spelled_only_in_the_task_registry():
    """No string constant outside aiayn/tasks/ equals an objective's name: code asks the registry."""
    names = {"seq2seq", "sequence_classification", "token_classification", "masked_lm"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if TASKS in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
    assert not found, found


def test_the_registry_knows_every_objective_by_its_name():
    from aiayn.tasks import OBJECTIVES, get_task

    assert {get_task(name).name for name in OBJECTIVES} == set(OBJECTIVES)


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


def _module_name(path: Path) -> str:
    """The dotted name of a file of the package (`aiayn/backends/cpu.py` -> `aiayn.backends.cpu`)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports() -> dict[str, set[str]]:
    """Each aiayn module -> the aiayn modules it imports, at the top of its file or inside a function."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imported_modules(ast.parse(path.read_text(encoding="utf-8")), set(modules)) - {name}
            for name, path in modules.items()}


def imported_modules(tree: ast.AST, modules: set[str]) -> set[str]:
    """The `modules` that the code in `tree` imports, wherever the import statement is.

    `from aiayn.backends import cpu` imports the module `aiayn.backends.cpu`; `from aiayn.backends import select`
    imports the package's `__init__`, `aiayn.backends`.
    """
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"line {node.lineno}: import by the full name, aiayn.X"
            imported.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                            for a in node.names)
    return imported & modules


def _circle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A shortest chain of imports from `start` back to itself, or None."""
    paths = {nxt: [start, nxt] for nxt in graph.get(start, ())}
    frontier = list(paths)
    while frontier:
        following = []
        for module in frontier:
            if module == start:
                return paths[module]
            for nxt in graph.get(module, ()):
                if nxt not in paths:
                    paths[nxt] = [*paths[module], nxt]
                    following.append(nxt)
        frontier = following
    return None


def test_no_import_circles_between_modules():
    """Inside a part as between parts: no module imports (directly or through others) a module that imports it."""
    graph = module_imports()
    circles = {" -> ".join(circle) for module in sorted(graph) if (circle := _circle_through(graph, module))}
    assert not circles, sorted(circles)


def test_the_module_graph_sees_imports_inside_functions():
    """The graph the circle test reads holds the imports a function makes when it runs, not only the file's top."""
    source = """
import torch
from aiayn.backends.shapes import row_class

def measure():
    from aiayn.backends import cpu, select
    import aiayn.nn.model
"""
    modules = {"aiayn.backends", "aiayn.backends.shapes", "aiayn.backends.cpu", "aiayn.nn.model", "aiayn.nn"}
    assert imported_modules(ast.parse(source), modules) == modules - {"aiayn.nn"}


# Test folders and files of no single part: the whole product as a user meets it, or the project's own checks.
CROSS_CUTTING = {"hardening", "docs", "benchmarks", "layout", "cuda", "seed004"}


def test_the_tests_mirror_the_package():
    """tests/<package>/test_<file>.py for a part that is a package (`nn`, `training`, `cli`, ...),
    tests/test_<module>.py for a top-level module (`config`, `export`, ...), so the test of what a change touches is
    found by its path."""
    tests = PACKAGE.parent / "tests"
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    stray = [str(path.relative_to(tests)) for path in tests.glob("test_*.py")
             if path.stem.removeprefix("test_") not in modules | CROSS_CUTTING]
    stray += [folder.name for folder in tests.iterdir()
              if folder.is_dir() and folder.name != "__pycache__" and folder.name not in packages | CROSS_CUTTING]
    assert not stray, f"move these to tests/<package>/test_<file>.py or tests/test_<module>.py: {stray}"


def test_every_command_module_is_registered():
    """Each aiayn/cli module that defines `register(subparsers)` is one of `COMMAND_MODULES`, so a command moved into
    a module of its own (cli/export.py, cli/translate.py) is not left out of the parser."""
    from aiayn.cli.main import COMMAND_MODULES

    defining = {path.stem for path in (PACKAGE / "cli").glob("*.py")
                if any(isinstance(node, ast.FunctionDef) and node.name == "register"
                       for node in ast.parse(path.read_text(encoding="utf-8")).body)}
    assert defining == set(COMMAND_MODULES), sorted(defining ^ set(COMMAND_MODULES))


def test_model_calls_return_one_type():
    """A module's `forward` (and a model's `encode` / `decode`) returns one type, whatever its flags: no `X | Y` or
    Union return. Attention weights come through `aiayn.nn.attention.attention_weights` (forward hooks) and every
    layer's states through `hidden_states`, not through a flag that turns a tensor into a tuple."""
    found = []
    for path in [*(PACKAGE / "nn").glob("*.py"), *(PACKAGE / "backends").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef) or node.name not in {"forward", "encode", "decode"}:
                continue
            returns = node.returns
            union = (isinstance(returns, ast.BinOp) and isinstance(returns.op, ast.BitOr)) or (
                isinstance(returns, ast.Subscript) and ast.unparse(returns.value).endswith(("Union", "Optional")))
            if returns is None or union:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.name} -> "
                             f"{ast.unparse(returns) if returns else 'no annotation'}")
    assert not found, found


def test_no_kind_flags_outside_the_plug_ins():
    """Outside aiayn/tasks/ nothing branches on what kind of objective a model serves (a flag or a model class):
    the code asks the task object, or the config's shape (`architecture`, `has_cross_attention`, `causal`) where a
    shape is what it builds or maps. Hugging Face's own Marian field keeps its name."""
    flags = ("encoder_decoder", "decodes", "labelled")
    classes = {"EncoderDecoderModel", "DecoderOnlyModel", "EncoderModel"}  # the three shapes build_model gives
    allowed = {"share_encoder_decoder_embeddings"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if TASKS in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute) \
                else [node.arg] if isinstance(node, (ast.keyword, ast.arg)) and node.arg else []
            names += [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else []
            # a name spelled as a string: getattr(config, "...")
            names += [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.isidentifier() else []
            found += [f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}" for name in names
                      if name not in allowed and any(flag in name for flag in flags)]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance",
                                                                                                  "issubclass"):
                kinds = [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.args[1])
                         if isinstance(n, (ast.Name, ast.Attribute))] if len(node.args) > 1 else []
                found += [f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.func.id} of {kind}" for kind in kinds
                          if kind in classes]
    assert not found, found
