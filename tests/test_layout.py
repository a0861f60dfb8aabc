"""The package's layers, checked from its import graph (parsed, not imported): no import circle; `formats/`
at the bottom, importing nothing else of the package; `train/` imported only by itself and the commands that
train or read training data (`dflash2 data`, `dflash2 train`, `dflash2 bench --tree-sim`); the library
(`dflash2_mlx`) never importing the commands (`dflash2_apps`); `server/`'s modules each importing only those
below it in `SERVER_LAYERS`; no function-local import of the package's own modules, which would hide an edge
from this graph (third-party imports may stay lazy where they are heavy or optional)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"dflash2_mlx": ROOT / "dflash2_mlx", "dflash2_apps": ROOT / "apps"}
TRAIN_USERS = ("dflash2_apps.data", "dflash2_apps.train", "dflash2_apps.tree_sim")
# the server's modules, bottom first: the protocol knows no scheduler, the scheduler no HTTP, ...
SERVER_LAYERS = (
    "schema",
    "protocol",
    "responses",
    "messages_api",
    "responses_api",
    "scheduler",
    "batched_worker",
    "http",
    "app",
)


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module of this project, line, whether the import is inside a function or class)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    nested = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        for n in ast.walk(f)
        if n is not f
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = (
                ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                if node.level
                else node.module
            )
            candidates = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for target in candidates:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, node.lineno, id(node) in nested))
    return found


@functools.cache  # parsed once per process: the rules below all read it (none changes it)
def graph() -> dict[str, list[tuple[str, int, bool]]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as a path that returns to its start, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def package_edges(g) -> dict[str, set[str]]:
    """Edges between modules, without those to a package's own __init__ from inside it (`from . import x`
    names a sibling module, which `imports` already resolves to the sibling)."""
    return {m: {t for t, _, _ in targets if not m.startswith(t + ".")} for m, targets in g.items()}


def test_no_import_circle():
    assert cycle(package_edges(graph())) is None


def test_formats_import_nothing_above_them():
    wrong = [
        f"{m} imports {t} (line {line})"
        for m, targets in graph().items()
        if m.startswith("dflash2_mlx.formats")
        for t, line, _ in targets
        if not t.startswith("dflash2_mlx.formats")
    ]
    assert not wrong


def test_train_is_imported_only_by_itself_and_the_training_commands():
    wrong = [
        f"{m} imports {t} (line {line})"
        for m, targets in graph().items()
        if not m.startswith("dflash2_mlx.train") and m not in TRAIN_USERS
        for t, line, _ in targets
        if t.startswith("dflash2_mlx.train")
    ]
    assert not wrong


def test_the_library_never_imports_the_commands():
    wrong = [
        f"{m} imports {t} (line {line})"
        for m, targets in graph().items()
        if m.startswith("dflash2_mlx")
        for t, line, _ in targets
        if t.startswith("dflash2_apps")
    ]
    assert not wrong


def test_the_server_modules_import_only_the_layers_below():
    layer = {f"dflash2_mlx.server.{name}": i for i, name in enumerate(SERVER_LAYERS)}
    server = {m for m in graph() if m.startswith("dflash2_mlx.server.")}
    assert server == set(layer)  # a new module of the package gets its place in SERVER_LAYERS
    wrong = [
        f"{m} imports {t} (line {line})"
        for m, targets in graph().items()
        if m in layer
        for t, line, _ in targets
        if t in layer and layer[t] >= layer[m]
    ]
    assert not wrong


def test_no_function_local_import_of_the_package():
    wrong = [
        f"{m} line {line}: {t}"
        for m, targets in graph().items()
        if m != "dflash2_apps.cli"
        for t, line, local in targets
        if local
    ]
    assert not wrong


@pytest.mark.parametrize("mutation", ["circle", "formats", "train", "library", "server", "local"])
def test_the_layout_tests_catch_each_breach(mutation, monkeypatch):
    """Each rule above fails on a graph with one breach added (the rules are not vacuous)."""
    real = graph()
    g = {m: list(t) for m, t in real.items()}
    if mutation == "circle":
        g["dflash2_mlx.formats.config"].append(("dflash2_mlx.loading", 1, False))
        assert cycle(package_edges(g)) is not None
    elif mutation == "formats":
        monkeypatch.setitem(
            globals(), "graph", lambda: {**g, "dflash2_mlx.formats.vocab": [("dflash2_mlx.target", 1, False)]}
        )
        with pytest.raises(AssertionError):
            test_formats_import_nothing_above_them()
    elif mutation == "train":
        monkeypatch.setitem(
            globals(), "graph", lambda: {**g, "dflash2_mlx.prompts": [("dflash2_mlx.train.data", 1, False)]}
        )
        with pytest.raises(AssertionError):
            test_train_is_imported_only_by_itself_and_the_training_commands()
    elif mutation == "library":
        monkeypatch.setitem(globals(), "graph", lambda: {**g, "dflash2_mlx.info": [("dflash2_apps.common", 1, False)]})
        with pytest.raises(AssertionError):
            test_the_library_never_imports_the_commands()
    elif mutation == "server":
        monkeypatch.setitem(
            globals(), "graph", lambda: {**g, "dflash2_mlx.server.scheduler": [("dflash2_mlx.server.http", 1, False)]}
        )
        with pytest.raises(AssertionError):
            test_the_server_modules_import_only_the_layers_below()
    else:
        monkeypatch.setitem(globals(), "graph", lambda: {**g, "dflash2_mlx.info": [("dflash2_mlx.loading", 9, True)]})
        with pytest.raises(AssertionError):
            test_no_function_local_import_of_the_package()


PATCHING = ("__class__ =", "types.FunctionType(", ".__globals__", '__dict__["rope"] =', "make_mask =")


def test_mlx_lm_is_patched_in_one_module():
    """Re-classing instances, rebuilding functions over other globals and shadowing model attributes happen in
    patches.py only (its docstring says what, why and for which mlx-lm)."""
    wrong = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for name, path in modules().items()
        if name != "dflash2_mlx.patches"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(p in line for p in PATCHING)
    ]
    assert not wrong
    assert all(
        any(p in line for line in (ROOT / "dflash2_mlx" / "patches.py").read_text().splitlines()) for p in PATCHING[:3]
    )  # the patterns match how patches.py does it


# -- the tests' own layout -------------------------------------------------------------------------------------


def imports_of_test_modules(folder: Path) -> list[str]:
    """`file:line: import` for every import of a test module (`test_*`, also as `tests.test_*`, `from tests import
    test_x` or `from . import test_x`), at any depth, in the Python files of `folder`."""

    def is_test_module(name: str) -> bool:
        return name.startswith(("test_", "tests.test_"))

    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names] if node.module in (None, "tests") else [node.module]
            else:
                continue
            if any(is_test_module(name) for name in names):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_test_module_imports_another():
    """The tests' shared parts live in tests/helpers.py (their fixtures in conftest.py): a test module that imports
    another runs the other's module-level code and collects its tests' names a second time, and ties the two
    modules' edits together."""
    wrong = imports_of_test_modules(ROOT / "tests")
    assert not wrong, f"import shared parts from tests/helpers.py instead (move them there): {wrong}"


@pytest.mark.parametrize(
    "line",
    [
        "from test_decode import prompts",
        "import tests.test_decode as d",
        "from tests import test_decode",
        "from . import test_decode",
        "def f():\n    from test_sampling import V",
    ],
)
def test_a_test_module_importing_another_is_named(tmp_path, line):
    (tmp_path / "helpers.py").write_text("import os\nfrom pathlib import Path\n")
    (tmp_path / "test_a.py").write_text(f"import pytest\nfrom helpers import prompts\n{line}\n")
    [found] = imports_of_test_modules(tmp_path)
    statement = line.splitlines()[-1].strip()
    assert found == f"test_a.py:{2 + len(line.splitlines())}: {statement}"


def test_the_version_lives_in_one_place():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dflash2_mlx.__version__"}
    assigned = [
        n
        for n in ast.parse((ROOT / "dflash2_mlx" / "__init__.py").read_text()).body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in n.targets)
    ]
    assert len(assigned) == 1 and isinstance(assigned[0].value, ast.Constant)
