"""The architecture as a test: imports point down only, and no module imports itself back.

Each project unit may import only the units listed for it (the same rules its `__init__` docstring states);
an import cycle anywhere fails too. Imports inside functions count (a lazy import is still a dependency),
and so do imports under `if TYPE_CHECKING:` (they never run, but a type one module needs of another is a
dependency all the same: a cycle hidden there is still a cycle).
"""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "minivllm", "server")

# unit -> the units it may import (a unit is a package prefix; the longest matching prefix applies)
RULES: dict[str, set[str]] = {
    "kernels": set(),
    "minivllm.config": set(),
    "minivllm.cache": {"minivllm.config"},
    "minivllm.cluster": set(),
    "minivllm.models": {"kernels"},
    "minivllm.outputs": {"minivllm.cache", "minivllm.config"},
    "minivllm.engine": {
        "minivllm.cache",
        "minivllm.models",
        "minivllm.config",
        "minivllm.outputs",
        "kernels",
    },
    "minivllm": {"minivllm", "kernels"},  # the entry points: llm, cli, replay, the package itself
    "server": {"server", "minivllm", "kernels"},
}


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the given top-level packages."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _import_nodes(tree: ast.AST):
    """Every import statement: at module level, in functions, under `if TYPE_CHECKING:`."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (a `from pkg import sub` of a submodule points at the submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a non-module attribute
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def unit_of(module: str, rules: dict[str, set[str]]) -> str | None:
    matches = [u for u in rules if module == u or module.startswith(u + ".")]
    return max(matches, key=len) if matches else None


def layering_violations(graph: dict[str, set[str]], rules: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        unit = unit_of(module, rules)
        for target in sorted(targets):
            target_unit = unit_of(target, rules)
            if target_unit is None or target_unit == unit:
                continue
            allowed = rules[unit]
            if not any(target_unit == a or target_unit.startswith(a + ".") for a in allowed):
                out.append(f"{module} imports {target} ({unit} may import only {sorted(allowed)})")
    return out


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def check_tree(root: Path, packages: tuple[str, ...], rules: dict[str, set[str]]) -> list[str]:
    modules = module_files(root, packages)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    problems = layering_violations(graph, rules)
    problems += [f"import cycle: {' <-> '.join(c)}" for c in import_cycles(graph)]
    return problems


# -- the project ------------------------------------------------------------------------------------------
def test_the_project_imports_point_down_only_without_cycles():
    assert check_tree(REPO, PACKAGES, RULES) == []


def test_every_folder_says_what_lives_there():
    for init in sorted((REPO / "minivllm").rglob("__init__.py")) + [REPO / "kernels" / "__init__.py"]:
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc, (
            f"{init.relative_to(REPO)} needs a docstring saying what it may import"
        )


def test_the_single_process_server_never_imports_ray():
    """Ray is an optional extra: the default server, the commands and the replay run without it. Only
    `minivllm serve --replicas` imports it (server.cluster)."""
    code = (
        "import sys\n"
        "import minivllm.cli, minivllm.replay, minivllm.cluster.routing, server.app, server.cli, server.serve\n"
        "from server.app import create_app\n"
        "create_app()\n"
        "rc = server.cli.main(['replay', '/no/such/trace', '--policy', 'lru', '--capacity', '1'])\n"
        "loaded = sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'server.cluster')))\n"
        "print(rc, loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "2 []"


def test_the_cache_and_the_engines_request_know_nothing_of_each_other():
    """The KV cache keeps its per-request state in its own KVRequest, which the engine's Sequence holds:
    neither module imports the other's side, not even for a type."""
    modules = module_files(REPO, ("minivllm", "kernels"))
    sequence = imports_of("minivllm.engine.sequence", modules["minivllm.engine.sequence"], modules)
    assert not {m for m in sequence if m.startswith("minivllm.cache")}
    for name, path in modules.items():
        if name.startswith("minivllm.cache"):
            assert not {m for m in imports_of(name, path, modules) if m.startswith("minivllm.engine")}, name


POOL_INTERNALS = {"pool", "refcount", "page_hash", "page_tokens", "children", "policy"}


def test_the_engine_reaches_kv_pages_only_through_the_kv_manager():
    """minivllm.cache.kv_manager owns page tables, refcounts, the prefix index and eviction: no module of
    minivllm.engine imports the pool or the policies, reads a pool attribute, or writes a page table."""
    modules = module_files(REPO, ("minivllm", "kernels"))
    for name, path in modules.items():
        if not name.startswith("minivllm.engine"):
            continue
        imported = imports_of(name, path, modules)
        assert not imported & {"minivllm.cache.page_pool", "minivllm.cache.eviction"}, name
        tree = ast.parse(path.read_text())
        read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not read & POOL_INTERNALS, f"{name} reads {sorted(read & POOL_INTERNALS)}"
        written = [
            t
            for n in ast.walk(tree)
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and t.attr == "page_table"
        ]
        calls = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Attribute)
            and n.func.value.attr == "page_table"
            and n.func.attr in ("append", "extend", "pop", "clear", "insert")
        ]
        assert not written and not calls, f"{name} changes a page table (the KV manager's job)"


# what the server may import of minivllm: the engine's public interface, never its inner parts
ENGINE_PUBLIC = {
    "minivllm",
    "minivllm.cli",
    "minivllm.config",
    "minivllm.shadow",
    "minivllm.cluster.routing",
    "minivllm.cache.page_hash",  # the chained page hash, which the replica router computes too
    "minivllm.cache.hints",  # a request's cache domain and pins
    "minivllm.engine.async_engine",
    "minivllm.engine.sampling_params",
    "minivllm.outputs",  # the engine's results: outputs, logprobs, finish reasons
    "minivllm.engine.validation",
    "minivllm.engine.grammar",
    "minivllm.models.loader",
    "minivllm.models.tokenizer",
    "minivllm.models.backend",  # the compute path, and what the user should fix about it (a slow BLAS)
}


def test_the_server_uses_only_the_engines_public_modules():
    modules = module_files(REPO, PACKAGES)
    for name, path in modules.items():
        if name.startswith("server"):
            inner = {m for m in imports_of(name, path, modules) if m.startswith("minivllm")} - ENGINE_PUBLIC
            assert not inner, f"{name} imports {sorted(inner)}: not the engine's public interface"


# -- the checker itself, on synthetic trees ----------------------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


SYNTHETIC_RULES = {"app": {"app", "core"}, "core": set()}


def test_checker_passes_a_clean_tree(tmp_path):
    _write(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/util.py": "import os\n",
            "core/model.py": "from core.util import os\nfrom . import util\n",
            "app/__init__.py": "from core import model\n",
            "app/main.py": "import core.model\nfrom app import helpers\n",
            "app/helpers.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from core.util import x\n",
        },
    )
    assert check_tree(tmp_path, ("app", "core"), SYNTHETIC_RULES) == []


def test_checker_finds_a_cycle_and_an_upward_import(tmp_path):
    _write(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/model.py": "def load():\n    from app.main import run  # upward, even when lazy\n",
            "app/__init__.py": "",
            "app/main.py": "from app.settings import x\n",
            "app/settings.py": "from . import main\n",  # app.main -> app.settings -> app.main
        },
    )
    problems = check_tree(tmp_path, ("app", "core"), SYNTHETIC_RULES)
    assert "import cycle: app.main <-> app.settings" in problems
    assert any(p.startswith("core.model imports app.main") for p in problems)
    assert len(problems) == 2


def test_checker_finds_a_cycle_hidden_under_type_checking(tmp_path):
    _write(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/pages.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from core.request import R\n",
            "core/request.py": "from core.pages import P\n",
        },
    )
    assert check_tree(tmp_path, ("core",), SYNTHETIC_RULES) == ["import cycle: core.pages <-> core.request"]
