"""The package's shape: layers that import downwards, no cycle, modules of a screenful or so.

Read from the source with :mod:`ast`, so nothing is imported and the tests take milliseconds.
Every import counts, at the top of a module, inside a function or under ``TYPE_CHECKING``:
a cycle hidden in a function is still two modules that cannot be read one after the other.

The package's folders and top-level modules stand in :data:`LAYERS`, top first (the order the
package's docstring tells): each may import only from the layers below it, so that each can be
read knowing only what lies under it. Units of one layer do not import each other.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mgtutor"

#: mgtutor's folders and top-level modules (each a unit), top layer first.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("bench",),  # python -m mgtutor.bench: launches through the public names
    ("mgtutor",),  # the public names, re-exported from below
    ("interactive",),  # controls that re-run a launch
    ("exercises",),  # checkers that launch a learner's function
    ("launcher",),  # the notebook's side: launch, Pool, Run, progress bars, the %%ddp magic
    ("rank",),  # the rank's side: its loop, the names a call sees, progress
    ("doctor",),  # a hang's diagnosis, and the ranks' side of it
    ("experiments",),  # a layout or a step run on ranks beside the planner's prediction
    ("measure",),  # what a rank measures, and its plots
    ("parallel", "plan"),  # what the notebooks build by hand; what is predicted, by formulas
    ("worker",),  # setup() and what fn asks of its rank
    ("checkpoint", "data", "errors", "hardware", "metrics", "models"),
    ("build",),  # this_build(): the platform facts every notebook branch reads
    # Layout, the ring formula, format_bytes, the messages and pickling both sides speak: these
    # import nothing of mgtutor.
    ("grid", "ring", "units", "wire"),
)


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _import_targets(name: str, path: Path) -> list[tuple[ast.stmt, str]]:
    """Each import statement of module ``name`` and the dotted name it imports, made absolute.

    ``from . import x`` in ``mgtutor.launcher.pool`` imports ``mgtutor.launcher.x``; ``from
    .a import b``, ``mgtutor.launcher.a.b`` (a module or a name in one: the callers tell).
    """
    package = _package_of(name, path)
    found: list[tuple[ast.stmt, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node, f"{base}.{alias.name}") for alias in node.names]
    return found


def _imported(name: str, path: Path, modules: dict[str, Path], *, top: bool = False) -> set[str]:
    """The mgtutor modules that ``name`` imports (a package's ``__init__`` for its names).

    With ``top``, an ``import mgtutor`` in a submodule counts too, as an import of the package's
    face (Python has loaded it first anyway, but the module reaches up for its names).
    """
    found = set()
    for _, target in _import_targets(name, path):
        while target not in modules and "." in target:
            target = target.rpartition(".")[0]
        # A module importing its own package's __init__ is how Python loads it anyway.
        inside = target in modules and target != name and not name.startswith(target + ".")
        if inside or (top and target == "mgtutor" and name != "mgtutor"):
            found.add(target)
    return found


def import_graph(*, top: bool = False) -> dict[str, set[str]]:
    """Each mgtutor module and the mgtutor modules it imports (``top``: see :func:`_imported`)."""
    modules = _modules()
    return {name: _imported(name, path, modules, top=top) for name, path in modules.items()}


def unit_of(module: str) -> str:
    """The folder or top-level module a module belongs to: ``mgtutor.measure.timing`` -> measure."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "mgtutor"


def unit_imports(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """Each pair of units (importer, imported) and the module imports that tie them."""
    pairs: dict[tuple[str, str], list[str]] = {}
    for name, targets in graph.items():
        for target in sorted(targets):
            if unit_of(name) != unit_of(target):
                pairs.setdefault((unit_of(name), unit_of(target)), []).append(f"{name} -> {target}")
    return pairs


def upward(
    pairs: dict[tuple[str, str], list[str]], layers: tuple[tuple[str, ...], ...]
) -> list[str]:
    """The imports that do not go down the layers (same layer or higher), or from a unit no
    layer holds."""
    level = {unit: i for i, layer in enumerate(layers) for unit in layer}
    wrong = []
    for (a, b), ties in sorted(pairs.items()):
        if a not in level or b not in level or level[a] >= level[b]:
            wrong += ties
    return wrong


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or round a longer loop (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_find_cycles_finds_a_loop_of_three_and_no_loop_in_a_chain() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_imports_inside_functions_and_under_type_checking() -> None:
    graph = import_graph()
    # _processes imports a module in a function; hardware imports units in a function.
    assert "mgtutor.rank.loop" in graph["mgtutor.launcher._processes"]
    assert "mgtutor.units" in graph["mgtutor.hardware"]
    assert "mgtutor" in import_graph(top=True)["mgtutor.bench"]  # import mgtutor, in a function


def test_upward_finds_an_import_up_or_sideways_and_passes_one_down() -> None:
    layers = (("top",), ("mid", "side"), ("low",))
    assert upward({("top", "low"): ["t -> l"], ("mid", "low"): ["m -> l"]}, layers) == []
    assert upward({("low", "mid"): ["l -> m"]}, layers) == ["l -> m"]
    assert upward({("mid", "side"): ["m -> s"]}, layers) == ["m -> s"]
    assert upward({("new", "low"): ["n -> l"]}, layers) == ["n -> l"]


def test_every_folder_and_top_level_module_stands_in_one_layer() -> None:
    units = {unit_of(name) for name in _modules()}
    placed = [unit for layer in LAYERS for unit in layer]
    assert len(placed) == len(set(placed)), "a unit stands in two layers"
    assert units == set(placed), (
        f"not in LAYERS: {sorted(units - set(placed))}; gone: {sorted(set(placed) - units)}"
    )


def test_every_import_between_folders_goes_down_the_layers() -> None:
    wrong = upward(unit_imports(import_graph(top=True)), LAYERS)
    assert not wrong, "imports up or across the layers:\n" + "\n".join(wrong)


def test_no_two_folders_import_each_other() -> None:
    pairs = unit_imports(import_graph(top=True))
    graph: dict[str, set[str]] = {}
    for a, b in pairs:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    cycles = find_cycles(graph)
    ties = [
        tie
        for cycle in cycles
        for (a, b), found in pairs.items()
        if {a, b} <= set(cycle)
        for tie in found
    ]
    assert not cycles, (
        "folders that import each other: "
        + "; ".join(" <-> ".join(c) for c in cycles)
        + "\n"
        + "\n".join(ties)
    )


def test_no_module_of_mgtutor_imports_itself_round_a_loop() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_module_says_its_job() -> None:
    # No line cap: one cut files where they grew long, not at their seams (issue 44). What a
    # module may use of another's is checked instead, by the private-names test.
    silent = [
        name
        for name, path in _modules().items()
        if not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert not silent, f"no docstring saying the module's job: {', '.join(silent)}"


def test_every_folder_of_mgtutor_has_a_folder_of_tests() -> None:
    tests = Path(__file__).resolve().parent
    folders = [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()]
    missing = [name for name in folders if not (tests / name / "__init__.py").exists()]
    assert not missing, f"tests/ has no folder for mgtutor/{', mgtutor/'.join(missing)}"


def test_no_two_modules_share_a_name() -> None:
    # A name says which module it is: `pipeline.py` in two folders makes every traceback and
    # every search ask "which one?" (issue 36).
    names = [path.name for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"]
    twice = sorted({name for name in names if names.count(name) > 1})
    assert not twice, f"module names used twice: {twice}"


def test_every_module_a_docstring_names_exists() -> None:
    # :mod:`.name` (beside the file) and :mod:`mgtutor.x` (from the top) name real modules.
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = path.parent
        for name in re.findall(r":mod:`~?([.\w]+)`", path.read_text()):
            if name.startswith("."):
                target = here / name[1:].replace(".", "/")
            else:
                target = PACKAGE.parent / name.replace(".", "/")
            if not (target.with_suffix(".py").exists() or (target / "__init__.py").exists()):
                missing.append(f"{path.relative_to(PACKAGE.parent)}: {name}")
    assert not missing, "docstrings name modules that do not exist: " + ", ".join(missing)


def _is_private(name: str) -> bool:
    """``_name``: one leading underscore; not ``__dunder__``, ``__mangled`` or ``_sunder_``.

    A ``_sunder_`` name (``_repr_html_``) is a protocol another library calls, not a secret.
    """
    return name.startswith("_") and not name.startswith("__") and not name.endswith("_")


def private_imports(modules: dict[str, Path], root: Path = PACKAGE.parent) -> list[str]:
    """``file:line name`` for each import of another mgtutor module's private name.

    A private module (``launcher._processes``) is private to its package: its package and the
    packages inside it may import it, nobody else. A private name (``_helper``) is
    private to its module: no other module imports it, sibling or not.
    """
    found = []
    for name, path in modules.items():
        package = _package_of(name, path)
        for node, target in _import_targets(name, path):
            parts = target.split(".")
            if parts[0] != "mgtutor":
                continue
            for i, part in enumerate(parts[1:], start=1):
                if not _is_private(part):
                    continue
                owner = ".".join(parts[:i])  # the package or module the part lies in
                if ".".join(parts[: i + 1]) in modules:  # a private module
                    allowed = package == owner or package.startswith(owner + ".")
                else:  # a private name of module `owner`
                    allowed = owner == name
                if not allowed:
                    where = path.relative_to(root)
                    found.append(f"{where}:{node.lineno} imports {target}")
                    break
    return found


def _class_attributes(tree: ast.AST) -> set[str]:
    """The private names a module's classes define: methods, class-level names, ``self.x =``."""
    names = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return {name for name in names if _is_private(name)}


def _imported_from_outside(tree: ast.AST) -> set[str]:
    """The names a module binds by importing from outside mgtutor (``os``, ``dist``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "mgtutor":
                    names.add(alias.asname or alias.name.split(".")[0])
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] != "mgtutor"
        ):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def private_attributes(modules: dict[str, Path], root: Path = PACKAGE.parent) -> list[str]:
    """``file:line name`` for each ``x._name`` that reaches into another module's class.

    The rule, kept simple: ``x._name`` where ``x`` is not ``self`` or ``cls``, ``_name`` is
    defined by a class (a method, a class-level name or a ``self._name =``) in another mgtutor
    module, and by no class of this module (a class may touch its own kind's privates, as
    ``other._key`` in ``__eq__``). Types are not followed, so a name imported from outside
    mgtutor (``os`` in ``os._exit``) is skipped: torch's and the standard library's private
    names are outside this test.
    """
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    defined = {name: _class_attributes(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        others = set().union(*(names for other, names in defined.items() if other != name))
        foreign = {"self", "cls"} | _imported_from_outside(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr in defined[name]:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in foreign:
                continue
            if node.attr in others:
                where = modules[name].relative_to(root)
                found.append(f"{where}:{node.lineno} uses .{node.attr}")
    return found


def test_the_private_name_checks_find_a_reach_in_and_pass_a_sibling(tmp_path: Path) -> None:
    package = tmp_path / "mgtutor"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": '"""."""\nfrom mgtutor.sub import _inner\n',
        "sub/__init__.py": '"""."""\n',
        "sub/_inner.py": '"""."""\nclass Box:\n    def _hidden(self):\n        self._n = 1\n',
        "sub/face.py": '"""."""\nfrom mgtutor.sub import _inner\nfrom ._inner import Box\n',
        "user.py": '"""."""\nimport os\nfrom mgtutor.sub.face import _helper\n'
        "def f(box):\n    box._n = 2\n    os._hidden()\n",
    }
    modules = {}
    for relative, text in files.items():
        path = package / relative
        path.write_text(text)
        parts = Path(relative).with_suffix("").parts
        modules[".".join(("mgtutor", *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    assert private_imports(modules, tmp_path) == [
        "mgtutor/__init__.py:2 imports mgtutor.sub._inner",
        "mgtutor/user.py:3 imports mgtutor.sub.face._helper",
    ]
    assert private_attributes(modules, tmp_path) == ["mgtutor/user.py:5 uses ._n"]  # not os._


def test_no_module_uses_another_modules_private_names() -> None:
    # A module that reaches into another's private names shows a seam in the wrong place
    # (issue 44): the name should be public, or the code should live with its user.
    modules = _modules()
    found = private_imports(modules) + private_attributes(modules)
    assert not found, "private names used from another module:\n" + "\n".join(found)
