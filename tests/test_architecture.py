"""The layer rules of the design card, and the schema's single source of truth."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import setuptools
from alembic import command

from migrations import alembic_config

ROOT = Path(__file__).resolve().parent.parent


def _imports(folder: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        mods: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = mods
    return found


def _scoped_imports(path: Path) -> list[tuple[str, bool]]:
    """(module, inside a function body) for every absolute import of `path`.

    Module level includes class bodies and `if TYPE_CHECKING:` blocks: what a type checker, a
    reader or a refactoring tool follows is a dependency whether or not it runs.
    """
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, in_function) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, in_function))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def _top(module: str) -> str:
    return module.split(".")[0]


def test_engine_is_pure_torch_distributed() -> None:
    # The engine reads the API's own models (api_schemas imports only pydantic), nothing else of ours.
    forbidden = {"service", "celery", "sqlalchemy", "fastapi", "kombu", "dptrain_cli", "migrations"}
    bad = {f: m & forbidden for f, m in _imports(ROOT / "workers" / "engine").items() if m & forbidden}
    assert bad == {}, f"the engine must not import {forbidden}: {bad}"


def test_the_sdk_reaches_no_service_code() -> None:
    # User scripts import `dptrain` in the ranks: it must not pull in the service, its database or
    # broker clients (nor need them installed). What it shares with the worker lives in rank_contract.
    forbidden = {
        "service",
        "celery",
        "sqlalchemy",
        "fastapi",
        "kombu",
        "dptrain_cli",
        "migrations",
        "psycopg",
    }
    bad = {f: m & forbidden for f, m in _imports(ROOT / "dptrain").items() if m & forbidden}
    assert bad == {}, f"the SDK must not import {forbidden}: {bad}"


# The ways code names a module for importing it by its name: importlib's and the builtin's.
_IMPORTERS = frozenset({"import_module", "__import__", "find_spec", "module_from_spec", "import_string"})


def _module_strings(path: Path) -> set[str]:
    """Every module `path` imports: statements (in functions too) and constant names given to an importer.

    A name held in a module-level constant (`PACKAGE = "x"; find_spec(PACKAGE)`) counts as well.
    """
    tree = ast.parse(path.read_text())
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if name in _IMPORTERS and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
            elif name in _IMPORTERS and isinstance(arg, ast.Name) and arg.id in constants:
                found.add(constants[arg.id])
    return found


def test_the_cli_imports_nothing_of_the_server_not_even_lazily() -> None:
    # `pip install dptrain` is the client: its CLI package never imports the service, the worker or
    # the server's commands, even inside a function or by a module's name in a string. It finds the
    # server's commands by their entry points (dptrain_cli/lazy.py), which dptrain_server registers:
    # every arrow between the two points from the server down to the client.
    server = {"service", "workers", "dptrain_server", "migrations"}
    bad = {
        str(path.relative_to(ROOT)): sorted(m for m in _module_strings(path) if _top(m) in server)
        for path in (ROOT / "dptrain_cli").rglob("*.py")
    }
    assert {f: m for f, m in bad.items() if m} == {}, f"dptrain_cli must not import {sorted(server)}"


def test_the_server_commands_are_registered_where_the_cli_finds_them() -> None:
    # The entry points of pyproject.toml name real commands of dptrain_server, and the ones the
    # CLI discovers on this install are those (a stale editable install would list others).
    from importlib.metadata import entry_points

    from dptrain_cli.lazy import GROUP

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][GROUP]
    assert all(v.startswith("dptrain_server.") for v in declared.values()), declared
    installed = {ep.name: ep.value for ep in entry_points(group=GROUP)}
    assert installed == declared, f"reinstall (make setup): installed {installed}, declared {declared}"
    for name in declared:
        assert callable(entry_points(group=GROUP)[name].load()), name


def test_api_schemas_import_only_pydantic() -> None:
    # The engine and the API both read these models: they must stay importable without either side.
    allowed = {"api_schemas", "pydantic", "pydantic_core", "__future__"}
    bad = {
        f: {m for m in mods if m not in allowed and m not in sys.stdlib_module_names}
        for f, mods in _imports(ROOT / "api_schemas").items()
    }
    assert {f: m for f, m in bad.items() if m} == {}, bad


@pytest.mark.e2e
def test_the_api_process_never_imports_torch() -> None:
    code = "import sys, service.main, service.dispatch; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.e2e
def test_the_worker_process_never_imports_torch() -> None:
    # The Celery worker only supervises torchrun: the events and checkpoint names it shares with the
    # ranks live in torch-free modules (workers/engine/events.py, checkpoint.py's lazy import).
    code = (
        "import sys, workers.celery_app, workers.tasks, workers.reconciler, workers.heartbeat; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_models_match_the_migrations(pg_url: str) -> None:
    # Raises if autogenerate would produce any operation: the models and migrations agree.
    command.check(alembic_config(pg_url))


def test_no_test_module_imports_another() -> None:
    # Shared helpers live in conftest, fixtures modules or helper modules; a test module importing
    # another one couples two suites and runs the other's module-level code.
    found: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad = {n for n in names if n.rsplit(".", 1)[-1].startswith("test_")}
            if bad:
                found.setdefault(str(path.relative_to(ROOT)), set()).update(bad)
    assert found == {}, f"test modules imported by others: {found}"


def test_user_code_and_examples_import_only_the_public_package() -> None:
    # What users copy must not reach into the worker: `from dptrain import Plan`, never `workers.*`.
    found = {**_imports(ROOT / "examples"), **_imports(ROOT / "tests" / "fixtures")}
    bad = {f: m & {"workers", "service"} for f, m in found.items() if m & {"workers", "service"}}
    assert bad == {}, f"user code imports the worker's modules: {bad}"


def test_nothing_of_the_worker_imports_the_sdk() -> None:
    # The SDK sits above the worker: the engine and the runner read the Plan, the datasets and the
    # ranks' variables from rank_contract, so no import of `dptrain` anywhere, lazy ones included.
    bad = {
        str(path.relative_to(ROOT)): sorted(m for m, _ in _scoped_imports(path) if _top(m) == "dptrain")
        for path in (ROOT / "workers").rglob("*.py")
    }
    assert {f: m for f, m in bad.items() if m} == {}, "workers/ imports the SDK (use rank_contract)"


def test_the_sdk_reaches_the_worker_only_from_inside_a_rank() -> None:
    # `import dptrain` must not load the worker's code (nor the service's): only a function that runs
    # in a rank (report, save_checkpoint, the collectives) may import workers.engine, and nothing else
    # of workers or service, at call time.
    module_level: dict[str, list[str]] = {}
    in_functions: dict[str, list[str]] = {}
    for path in (ROOT / "dptrain").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        for module, in_function in _scoped_imports(path):
            if _top(module) not in {"workers", "service"}:
                continue
            if not in_function:
                module_level.setdefault(rel, []).append(module)
            elif not module.startswith("workers.engine"):
                in_functions.setdefault(rel, []).append(module)
    assert module_level == {}, f"dptrain imports the worker or the service at module level: {module_level}"
    assert in_functions == {}, f"dptrain reaches past workers.engine: {in_functions}"


def test_the_rank_contract_imports_none_of_its_users() -> None:
    # rank_contract is the one home of what the SDK, the worker and the engine share: it sits below
    # all of them and needs only the standard library, api_schemas, torch and numpy.
    allowed = {"rank_contract", "api_schemas", "torch", "numpy"}
    bad = {
        str(path.relative_to(ROOT)): sorted(
            m for m, _ in _scoped_imports(path) if _top(m) not in allowed | sys.stdlib_module_names
        )
        for path in (ROOT / "rank_contract").rglob("*.py")
    }
    assert {f: m for f, m in bad.items() if m} == {}, f"rank_contract imports more than it may: {bad}"


@pytest.mark.e2e  # a fresh interpreter: this one has torch loaded already
def test_the_ranks_environment_names_import_without_torch() -> None:
    # The light client (no torch installed) imports dptrain, which reads rank_contract.env.
    code = "import sys, rank_contract.env; assert 'torch' not in sys.modules, sorted(sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _our_top_level_packages() -> list[str]:
    """The top-level packages pyproject's packages.find ships: every one of ours, new ones included."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    found = setuptools.find_namespace_packages(where=str(ROOT), include=find["include"])
    return sorted({name.split(".")[0] for name in found})


def _module_files(packages: list[str]) -> dict[str, Path]:
    """Each importable module of `packages` (`a.b`) and the file it names (a.b's module or __init__)."""
    files: dict[str, Path] = {}
    for top in packages:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imported_modules(path: Path, module: str, files: dict[str, Path]) -> set[str]:
    """Every module of ours that `path` imports anywhere: top level, TYPE_CHECKING, inside functions."""
    # The package a relative import starts from: the module's own for an __init__, else its parent.
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import name` names the submodule pkg.name when there is one, else pkg itself.
            named |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
    return {name for name in named if name in files} - {module}


def test_no_import_cycles_between_our_files() -> None:
    # Every import counts, a type-only one too: a cycle couples its files whichever way it is written,
    # and the fix is a module below both (workers/node_run.py, api_schemas/base.py).
    files = _module_files(_our_top_level_packages())
    graph = {module: _imported_modules(path, module, files) for module, path in files.items()}
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        reach[start] = seen
    # Two files are in one cycle when each reaches the other (a strongly connected component).
    cycles = {
        frozenset({m} | {other for other in reach[m] if m in reach[other]}) for m in graph if m in reach[m]
    }
    named = sorted(sorted(str(files[m].relative_to(ROOT)) for m in cycle) for cycle in cycles)
    assert named == [], f"import cycles between files (each imports the others, directly or not): {named}"
