"""The house as docs/architecture.md draws it: `runtime/`'s rooms (a subpackage or a top-level
module each) on floors, from their imports. Every arrow runs down (no circle, none
back up, also among the modules inside each package), the map in the docs is the code's, and
no function in the scheduler or the KV plane branches past COMPLEXITY_LIMIT."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNTIME = REPO / "runtime"
COMPLEXITY_LIMIT = 15  # radon's cyclomatic complexity, counted as `complexity` does


@functools.cache
def _parsed() -> tuple[tuple[str, ast.Module], ...]:
    out = []
    for path in sorted(RUNTIME.rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out.append((name.removesuffix(".__init__"), ast.parse(path.read_text(), str(path))))
    return tuple(out)


def _modules() -> Iterator[tuple[str, ast.Module]]:
    return iter(_parsed())


def _imports(tree: ast.Module, package: str) -> set[str]:
    """The runtime modules `tree` imports, anywhere in it: an import made inside a function
    (a CLI subcommand, the scheduler process's model runner) follows the same directions."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            out |= {f"{base}.{a.name}" for a in node.names}  # a module, or a name in one
    return {m for m in out if m == "runtime" or m.startswith("runtime.")}


def _graph(room_of: dict[str, str]) -> dict[str, set[str]]:
    """Room -> the rooms it imports, for `room_of` (module -> room; modules left out: none)."""
    modules = dict(_modules())
    graph: dict[str, set[str]] = {room: set() for room in room_of.values()}
    for name, tree in modules.items():
        if name not in room_of:
            continue
        package = name if (RUNTIME.parent / name.replace(".", "/") / "__init__.py").exists() \
            else name.rpartition(".")[0]
        for target in _imports(tree, package):
            while target and target not in room_of:  # `from runtime.x import name`
                target = target.rpartition(".")[0]
            if target and room_of[target] != room_of[name]:
                graph[room_of[name]].add(room_of[target])
    return graph


def _floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """A room's floor: one above the highest room it imports; raises on a circle."""
    floors: dict[str, int] = {}
    visiting: list[str] = []

    def floor(room: str) -> int:
        if room in floors:
            return floors[room]
        assert room not in visiting, f"import circle: {' -> '.join([*visiting, room])}"
        visiting.append(room)
        floors[room] = 1 + max((floor(r) for r in graph[room]), default=0)
        visiting.pop()
        return floors[room]

    for room in graph:
        floor(room)
    return floors


def runtime_rooms() -> dict[str, str]:
    """Module -> its room: `name/` for a subpackage of runtime, `name` for a top-level module,
    `runtime` for the package itself."""
    out = {}
    for name, _ in _modules():
        parts = name.split(".")
        if len(parts) == 1:
            out[name] = "runtime"
        elif (RUNTIME / parts[1]).is_dir():
            out[name] = f"{parts[1]}/"
        else:
            out[name] = parts[1]
    return out


def documented_floors() -> dict[str, int]:
    """The map's rooms and floors, from docs/architecture.md's `floor N  room room ...` lines
    (and the lines that go on with that floor's rooms)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    out, floor = {}, None
    for line in text.split("## The map", 1)[1].split("```")[1].splitlines():
        heading = re.match(r"floor (\d+)\s+(.*)$", line)
        if heading:
            floor, line = int(heading[1]), heading[2]
        elif floor is None or re.search(r"[│▼·]", line) or not line.startswith(" "):
            continue
        for room in re.sub(r"\(.*?\)", " ", line).split():
            if re.fullmatch(r"[a-z_]+/?", room):
                out[room] = floor
    return out


def test_the_docs_map_is_the_code_and_every_arrow_runs_down() -> None:
    floors = _floors(_graph(runtime_rooms()))
    assert documented_floors() == floors, (
        "docs/architecture.md's map differs from the imports: "
        f"{sorted(set(documented_floors().items()) ^ set(floors.items()))}")


def test_no_circle_inside_a_package() -> None:
    packages = {r.rstrip("/") for r in runtime_rooms().values() if r.endswith("/")}
    for package in sorted(packages):
        prefix = f"runtime.{package}"
        rooms = {m: m for m in runtime_rooms() if m == prefix or m.startswith(prefix + ".")}
        rooms.pop(prefix, None)  # the package's __init__ re-exports: not a room of its own
        _floors(_graph(rooms))  # raises on a circle


def complexity(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Cyclomatic complexity as radon counts it: 1, +1 per if / elif / conditional expression /
    loop (and its else) / assert / comprehension (and each of its ifs), +1 per except handler
    (and a try's else), +(n - 1) per boolean operator over n operands, +cases of a match;
    functions nested in `fn` count toward it."""
    score = 1
    for node in ast.walk(fn):
        if isinstance(node, ast.If | ast.IfExp | ast.Assert):
            score += 1
        elif isinstance(node, ast.For | ast.AsyncFor | ast.While):
            score += 1 + bool(node.orelse)
        elif isinstance(node, ast.Try):
            score += len(node.handlers) + bool(node.orelse)
        elif isinstance(node, ast.BoolOp):
            score += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            score += 1 + len(node.ifs)
        elif isinstance(node, ast.Match):
            score += len(node.cases)
    return score


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}.{item.name}", item


def test_the_scheduler_and_the_kv_plane_branch_little() -> None:
    over = {}
    for name, tree in _modules():
        if name.startswith(("runtime.scheduler", "runtime.disagg")):
            for qualname, fn in _functions(tree):
                if complexity(fn) > COMPLEXITY_LIMIT:
                    over[qualname] = complexity(fn)
    assert not over, f"over {COMPLEXITY_LIMIT}: {over}"


def test_the_complexity_count_counts_what_radon_does() -> None:
    fn = ast.parse(
        "def f(x):\n"
        "    if x and x > 1 or x < -1:\n        return [y for y in x if y]\n"
        "    elif x:\n        assert x\n"
        "    for i in x:\n        pass\n    else:\n        pass\n"
        "    try:\n        pass\n    except ValueError:\n        pass\n"
        "    except KeyError:\n        pass\n"
        "    return 1 if x else 2\n").body[0]
    assert isinstance(fn, ast.FunctionDef)
    # 1 + if 1 + and/or 2 + comprehension 2 + elif 1 + assert 1 + for/else 2 + 2 handlers
    # + the conditional expression 1 (radon says 13 for this function)
    assert complexity(fn) == 13
