"""The house rules on the package's shape (STYLE.md; issues 15 and 34), checked on the source:

* no module over 500 lines, no function on the fetch path over 60 lines, no ``# fmt: skip``;
* the layers: nothing outside ``tensorwire/transport`` imports a backend module or compares a
  built-in transport's name; the transport layer imports neither Ray nor a layer above it;
* no import circle among the package's modules (imports inside functions count too);
* every built-in transport lives under ``transport/backends``;
* nothing walks the caller's stack (issue 35): no ``sys._getframe``, frame attributes or
  ``inspect.stack``; no private attribute of a Ray object read outside ``runtime/ray/surface.py``'s list,
  and no other library's private attribute read unlisted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tensorwire.transport.registry import BUILTIN_TRANSPORTS

PACKAGE = Path(__file__).resolve().parent.parent / "tensorwire"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
TRANSPORT = PACKAGE / "transport"
# What a fetch runs through: the runtime's get, the agent and its dispatch, every transport.
FETCH_PATH = [PACKAGE / "runtime" / n for n in ("api.py", "refs/reading.py", "refs/placement.py", "refs/ref.py")]
FETCH_PATH += sorted(TRANSPORT.rglob("*.py"))
COLLECTIVES = PACKAGE / "collectives"
RUNTIME = PACKAGE / "runtime"
# Transport names that are not ours to hide: the collectives' torch.distributed backends.
NAME_ALLOWED = {("collectives/groups/group.py", "gloo"), ("collectives/groups/group.py", "nccl")}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (absolute names; relative resolved)."""
    found = set()
    package = _name(path) if path.name == "__init__.py" else _name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            head = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            found.add(head)
            found.update(f"{head}.{alias.name}" for alias in node.names)
    return found


def test_the_package_has_its_rooms():
    rooms = {p.relative_to(TRANSPORT).parts[0] for p in TRANSPORT.rglob("*.py") if p.parent != TRANSPORT}
    assert {"agent", "backends", "hw"} <= rooms
    assert {"contract.py", "registry.py", "selector.py", "costs.py"} <= {p.name for p in TRANSPORT.glob("*.py")}
    assert (TRANSPORT / "backends" / "null.py").is_file()


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_at_most_500_lines_and_not_compressed(path: Path):
    text = path.read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines (limit {MAX_MODULE_LINES})"
    assert "fmt: skip" not in text, f"{path.relative_to(PACKAGE)} joins lines with # fmt: skip: format it"


def test_collectives_and_runtime_have_their_rooms():
    """Issue 53: ``ls tensorwire/collectives tensorwire/runtime`` shows the architecture."""
    assert {p.name for p in COLLECTIVES.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "groups",
        "weight_sync",
    }
    assert [p.name for p in COLLECTIVES.glob("*.py")] == ["__init__.py"]
    weight_sync = COLLECTIVES / "weight_sync"
    rooms = {p.name for p in weight_sync.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms == {"planning", "protocol", "members", "streams", "commit", "recovery", "report", "model"}
    assert {p.name for p in RUNTIME.iterdir() if p.is_dir() and p.name != "__pycache__"} == {"refs", "ray"}


def test_what_works_without_ray_imports_no_ray():
    """``runtime/refs`` and the transport layer never import Ray (``runtime/ray`` does, lazily)."""
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in sorted((RUNTIME / "refs").rglob("*.py"))
        for name in sorted(_imports(path))
        if name == "ray" or name.startswith(("ray.", "tensorwire.runtime.ray.")) or name == "tensorwire.runtime.ray"
    ]
    assert not offenders, offenders


def _long_functions(path: Path) -> list[str]:
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


@pytest.mark.parametrize("path", sorted(COLLECTIVES.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_in_the_collectives_are_at_most_60_lines(path: Path):
    long = _long_functions(path)
    assert not long, f"{path.relative_to(PACKAGE)}: functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"


@pytest.mark.parametrize("path", FETCH_PATH, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_on_the_fetch_path_are_at_most_60_lines(path: Path):
    long = _long_functions(path)
    assert not long, f"{path.relative_to(PACKAGE)}: functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"


def test_nothing_outside_the_transport_layer_imports_a_backend():
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in _modules()
        if not path.is_relative_to(TRANSPORT)
        for name in sorted(_imports(path))
        if name.startswith("tensorwire.transport.backends")
    ]
    assert not offenders, offenders


def test_nothing_outside_the_transport_layer_names_a_builtin_transport():
    # nixl is ours too (an entry point); "local" and "host" are also ordinary words (Ray's local mode, host memory)
    names = (set(BUILTIN_TRANSPORTS) | {"nixl"}) - {"local", "host"}
    offenders = []
    for path in _modules():
        if path.is_relative_to(TRANSPORT) or path.is_relative_to(PACKAGE / "bench"):
            continue  # the bench names its baselines: Ray's own transports, bare libraries
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            is_name = isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
            if is_name and (where, node.value) not in NAME_ALLOWED:
                offenders.append(f"{where}:{node.lineno} {node.value!r}")
    assert not offenders, offenders


def test_the_transport_layer_imports_neither_ray_nor_the_layers_above():
    above = ("ray", "tensorwire.runtime", "tensorwire.collectives", "tensorwire.bench", "tensorwire.cli")
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in sorted(TRANSPORT.rglob("*.py"))
        for name in sorted(_imports(path))
        if any(name == a or name.startswith(a + ".") for a in above)
    ]
    assert not offenders, offenders


FRAME_FUNCTIONS = {
    ("sys", "_getframe"),
    ("sys", "_current_frames"),
    ("inspect", "currentframe"),
    ("inspect", "stack"),
    ("inspect", "getouterframes"),
    ("traceback", "extract_stack"),
    ("traceback", "walk_stack"),
}
FRAME_ATTRIBUTES = {"f_back", "f_code", "f_locals", "f_globals", "tb_frame"}


def _frame_walks(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value.id if isinstance(node.value, ast.Name) else ""
        if (owner, node.attr) in FRAME_FUNCTIONS or node.attr in FRAME_ATTRIBUTES:
            found.append(f"{node.lineno} .{node.attr}")
    return found


def test_nothing_walks_the_callers_stack():
    offenders = [
        f"{path.relative_to(PACKAGE)}:{found}" for path in _modules() for found in _frame_walks(path.read_text())
    ]
    assert not offenders, offenders


def test_the_stack_check_finds_a_frame_walk():
    walker = "import inspect, sys\n\ndef caller():\n    return sys._getframe(1).f_back, inspect.stack()\n"
    assert sorted(_frame_walks(walker)) == ["4 ._getframe", "4 .f_back", "4 .stack"]
    assert _frame_walks("import torch\n\ntorch.stack([])\n") == []


# Private attributes of Ray objects the package may touch, in runtime/ray/surface.py only,
# where each is listed with why (tests/integration/test_ray_surface.py fails naming it if Ray
# changes it).
RAY_PRIVATE_LISTED = {"_ray_weak_ref", "_ray_system"}


# Other libraries' private attributes the package reads, each with whose and why; any other
# private attribute it reads must be one the package defines itself.
OTHER_PRIVATE_LISTED = {
    "_replace": "NamedTuple's documented method",
    "_fields": "NamedTuple's documented attribute",
    "_Options": "torch.distributed's ProcessGroup options (gloo / nccl groups)",
    "_share_cuda_": "torch: a CUDA storage's IPC handle (cuda_ipc backend)",
    "_new_shared_cuda": "torch: a storage from a CUDA IPC handle (cuda_ipc backend)",
    "_CFuncPtr": "ctypes' function pointer type (cma backend)",
}


def _own_names() -> set[str]:
    """Names the package itself defines (attributes it assigns, functions, classes, module
    names, import aliases): private attributes by these names are its own."""
    own = {"_ray"}  # the prefix itself, in a check of names
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.alias):
                own.add(node.asname or node.name.split(".")[-1])
    return own


def test_private_ray_attributes_only_as_listed():
    own = _own_names()
    offenders = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "value", None)
            private = isinstance(name, str) and name.startswith("_ray") and not name.startswith("__ray")
            listed_here = name in RAY_PRIVATE_LISTED and path == RUNTIME / "ray" / "surface.py"
            if private and name not in own and not listed_here:
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {name}")
    assert not offenders, offenders
    surface = (RUNTIME / "ray" / "surface.py").read_text()
    assert all(name in surface for name in RAY_PRIVATE_LISTED)


def test_no_other_private_attribute_is_read_unlisted():
    """Any ``x._name`` the package reads is its own or listed (a Ray private such as
    ``handle._actor_id`` fails here even without the ``_ray`` prefix)."""
    own = _own_names()
    offenders = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.attr}"
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in own
        and node.attr not in OTHER_PRIVATE_LISTED
        and node.attr not in RAY_PRIVATE_LISTED
    ]
    assert not offenders, offenders
    probe = ast.parse("def f(handle):\n    return handle._actor_id\n")
    found = [n.attr for n in ast.walk(probe) if isinstance(n, ast.Attribute) and n.attr not in own]
    assert found == ["_actor_id"]  # the check sees such a read


def test_builtin_transports_live_under_backends():
    for name, target in BUILTIN_TRANSPORTS.items():
        assert target.startswith("tensorwire.transport.backends."), (name, target)


def test_no_import_circles():
    modules = {_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imports(path):
            target = imported
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and modules[target].name != "__init__.py":
                deps.add(target)
        graph[name] = deps
    circles = _strongly_connected(graph)
    assert not circles, [" -> ".join(sorted(c)) for c in circles]


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root, edges in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(edges)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_circle_check_finds_a_circle():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _strongly_connected({"a": {"b"}, "b": set()}) == []
