"""The code's layout, read from its own imports: Horovod behind ``distributed/``, every arrow pointing down."""

import ast
import pathlib

import hvd_train

ROOT = pathlib.Path(hvd_train.__file__).parent

# Lowest first: a module may import its own layer and the layers below it, never one above.
LAYERS = [
    {"__init__", "errors", "log", "files", "compat"},
    {"distributed"},
    {"data", "demo"},
    {"config"},
    {"model"},
    {"results"},
    {"training"},
    {"perf", "experiments"},
    {"commands"},
    {"cli", "__main__"},
]
# Horovod's runner and its build flags, not the ranks' library (named in distributed/__init__.py).
HOROVOD_OUTSIDE = {"commands/launch.py", "commands/doctor.py"}


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, at any depth of its code (a function's own imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _modules():
    return sorted(p for p in ROOT.rglob("*.py"))


def _layer(part: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if part in names)


def test_only_distributed_imports_horovod():
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in _modules()
        if path.relative_to(ROOT).parts[0] != "distributed" and path.relative_to(ROOT).as_posix() not in HOROVOD_OUTSIDE
        for line, name in _imports(path)
        if name == "horovod" or name.startswith("horovod.")
    ]
    assert not wrong, "Horovod is called through hvd_train.distributed only:\n" + "\n".join(wrong)


def test_no_module_imports_a_layer_above_its_own():
    up = []
    for path in _modules():
        rel = path.relative_to(ROOT)
        here = _layer(rel.parts[0].removesuffix(".py"))
        for line, name in _imports(path):
            parts = name.split(".")
            if parts[0] != "hvd_train" or len(parts) < 2:
                continue
            there = _layer(parts[1])
            if there > here:
                up.append(f"{rel}:{line} imports {name}")
    assert not up, "arrows that run back up:\n" + "\n".join(up)


def test_every_part_of_the_package_has_a_layer_and_no_module_is_over_450_lines():
    parts = {p.relative_to(ROOT).parts[0].removesuffix(".py") for p in _modules()}
    assert parts <= set().union(*LAYERS)
    long = [f"{p.relative_to(ROOT)}: {n}" for p in _modules() if (n := len(p.read_text().splitlines())) > 450]
    assert not long, "modules over 450 lines:\n" + "\n".join(long)
