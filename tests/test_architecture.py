"""The layer rules of the design card, and the schema's single source of truth."""

from __future__ import annotations

import ast
import re
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


NODE_SIDE = ("workers.node", "workers.attempt", "workers.sandbox", "workers.pyenv", "workers.reporting")


def test_the_rank_side_imports_nothing_of_the_node_side() -> None:
    # workers/engine and workers/command run inside a rank, in the sandbox: the node starts them by
    # module path (torchrun's -m, --run-path), so nothing there may need the node's code, the
    # service, its database or its broker, even in a function (a lazy import still runs in a rank).
    def node_side(module: str) -> bool:
        if _top(module) in {"service", "celery", "kombu", "sqlalchemy", "fastapi", "migrations"}:
            return True
        return any(module == side or module.startswith(side + ".") for side in NODE_SIDE)

    bad = {
        str(path.relative_to(ROOT)): sorted(m for m, _ in _scoped_imports(path) if node_side(m))
        for side in ("engine", "command")
        for path in (ROOT / "workers" / side).rglob("*.py")
    }
    assert {f: m for f, m in bad.items() if m} == {}, f"rank-side code imports the node side: {bad}"
    # Every file of workers/ is in a package of one side or the other: a new one must choose.
    packages = {p.name for p in (ROOT / "workers").iterdir() if (p / "__init__.py").is_file()}
    assert packages == {"engine", "command"} | {s.split(".")[1] for s in NODE_SIDE}, packages
    loose = sorted(p.name for p in (ROOT / "workers").glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules directly under workers/, on neither side: {loose}"


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
        "import sys, workers.node.celery_app, workers.node.tasks, workers.node.reconciler, "
        "workers.node.heartbeat; "
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


def test_failure_types_are_named_only_where_they_are_declared() -> None:
    # The retry rule judges a failure by its type's name (workers/attempt/end.py), and each of our
    # types declares whether it is retried in rank_contract/failures.py. A name written out anywhere
    # else survives a rename there and silently becomes another type, retried by default; a literal
    # given to JobError or ErrorEvent is a type the registry does not know at all.
    from rank_contract.failures import Failure

    registry = ROOT / "rank_contract" / "failures.py"
    names = {failure.value for failure in Failure}
    found: list[str] = []
    for top in ("workers", "service", "rank_contract", "api_schemas"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == registry:
                continue
            tree = ast.parse(path.read_text())
            # `__all__` names an exception class of that name, not its wire type.
            exported = {
                id(c)
                for node in ast.walk(tree)
                if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__all__" for t in node.targets)
                for c in ast.walk(node.value)
            }
            for node in ast.walk(tree):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Call):
                    called = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                    found += [
                        f"{where}: {called}({kw.arg}={kw.value.value!r})"
                        for kw in node.keywords
                        if called in ("JobError", "ErrorEvent")
                        and kw.arg in ("type", "error_type")
                        and isinstance(kw.value, ast.Constant)
                    ]
                elif isinstance(node, ast.Constant) and node.value in names and id(node) not in exported:
                    found.append(f"{where}: {node.value!r}")
    assert found == [], f"failure types named outside rank_contract/failures.py (use Failure): {found}"


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
    # and the fix is a module below both (workers/attempt/node_run.py, api_schemas/base.py).
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


# --- Only rank_contract/layout.py builds paths under the artifact root -------------------------------
#
# The rule, checked on the syntax tree: outside the layout module, no path is built from a name the
# layout defines. A path is built by `/`, by os.path.join, Path(...), .joinpath(...), .with_name(...),
# and by the functions that take a folder's relative path (rank_contract.files, workers.tail); a
# name is one of `layout.NAMES` or a templated name the layout makes (`attempt-{n}`, `rank{k}.log`),
# written as a literal, an f-string or a module constant of the same file. An absolute literal
# ("/tmp") is a host path, never one under the artifact root.
_LAYOUT_TEMPLATES = ("attempt-*", "node-*", "rank*.log", "rank*.jsonl", "rank*.json", "rank*", "*.tar.gz")
_PATH_BUILDERS = frozenset({
    "join", "joinpath", "Path", "PurePath", "PosixPath", "with_name",
    "open_beneath", "read_beneath", "create_beneath", "touch_beneath", "open_folder", "folder", "TailSet",
})  # fmt: skip
# (name, the path it is joined to): a job's Python environment builds in its own folder of the
# environment cache (`<env>/setup/tmp`), which is not under the artifact root.
_NOT_THE_LAYOUTS = frozenset({("tmp", "root / 'setup'"), ("tmp", "setup")})
_HOLE = "\x00"  # what an f-string's `{...}` stands for


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """`NAME = "text"` (and `A, B = "a", "b"`) at module level: names a path may be built from."""
    found: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs: list[tuple[ast.expr, ast.expr]] = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts, strict=False))
            for name, value in pairs:
                if (
                    isinstance(name, ast.Name)
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, str)
                ):
                    found[name.id] = value.value
    return found


def _path_text(node: ast.expr, strings: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return strings.get(node.id)
    if isinstance(node, ast.JoinedStr):
        return "".join(
            v.value if isinstance(v, ast.Constant) else (_path_text(v.value, strings) or _HOLE)
            for v in node.values
            if isinstance(v, (ast.Constant, ast.FormattedValue))
        )
    return None


def _layout_name_in(text: str) -> str | None:
    from rank_contract import layout

    if text.startswith("/"):
        return None
    templates = [re.compile(re.escape(t).replace(r"\*", "[^/]+")) for t in _LAYOUT_TEMPLATES]
    for segment in text.split("/"):
        if segment in layout.NAMES or (_HOLE in segment and any(t.fullmatch(segment) for t in templates)):
            return segment.replace(_HOLE, "{}")
    return None


def _layout_paths_built(source: str) -> list[tuple[int, str]]:
    """(line, name) for each path `source` builds from a name of the job layout."""
    tree = ast.parse(source)
    strings = _string_constants(tree)
    found = []
    for node in ast.walk(tree):
        joined: list[tuple[ast.expr, ast.expr | None]] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            joined = [(node.right, node.left), (node.left, None)]
        elif isinstance(node, ast.Call):
            func = node.func
            called = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            if called in _PATH_BUILDERS:
                joined = [(arg, None) for arg in node.args]
        for part, onto in joined:
            text = _path_text(part, strings)
            name = _layout_name_in(text) if text is not None else None
            if (
                name is not None
                and (name, ast.unparse(onto) if onto is not None else "") not in _NOT_THE_LAYOUTS
            ):
                found.append((node.lineno, name))
    return found


def test_only_the_layout_module_builds_paths_under_the_artifact_root() -> None:
    # One module names every folder and file of a job (rank_contract/layout.py): the API, the worker
    # and the ranks then look for a job's files where they are, and a change of the layout is one edit.
    layout_module = ROOT / "rank_contract" / "layout.py"
    built = {
        f"{path.relative_to(ROOT)}:{line}": name
        for package in ("service", "workers", "dptrain", "rank_contract", "dptrain_server", "api_schemas")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != layout_module
        for line, name in _layout_paths_built(path.read_text())
    }
    assert built == {}, f"paths built from the job layout's names outside rank_contract/layout.py: {built}"


class TestTheLayoutRule:
    """The rule above catches each way a path under the artifact root was built before the layout."""

    @pytest.mark.parametrize(
        ("source", "name"),
        [
            ('p = run_dir / "logs" / f"rank{rank}.log"', "rank{}.log"),
            ('p = artifacts / "jobs" / job_id', "jobs"),
            ('p = os.path.join(root, "checkpoints")', "checkpoints"),
            ('p = job_dir / f"attempt-{n}" / f"node-{r}"', "node-{}"),
            ('f = open_beneath(root, f"jobs/{job_id}/checkpoints/{name}")', "jobs"),
            ('TMP = "tmp"\ndef f(run_dir):\n    return run_dir / TMP', "tmp"),
            ('tails = TailSet(run_dir, "events", "rank*.jsonl")', "events"),
            ('p = Path(run_dir, "spec.json")', "spec.json"),
        ],
    )
    def test_a_path_built_from_a_layout_name_is_caught(self, source: str, name: str) -> None:
        found = [n for _, n in _layout_paths_built(source)]
        assert name in found, f"expected {name!r} among the names caught in {source!r}, got {found}"

    @pytest.mark.parametrize(
        "source",
        [
            'router = v1_router("jobs")',  # a URL's words, no path
            'rows = {"logs": [], "checkpoints": []}',
            'short = Path("/tmp")',  # a host path
            'url = f"/v1/jobs/{job_id}/checkpoints"',
            'p = cache / f"{key}.lock"',
            'p = root / "setup" / "tmp"',  # an environment's own build folder
        ],
    )
    def test_other_strings_are_left_alone(self, source: str) -> None:
        assert _layout_paths_built(source) == [], source

    def test_the_templates_cover_every_name_the_layout_makes(self) -> None:
        # A name added to the layout is refused elsewhere only once NAMES or a template says it.
        from rank_contract import layout

        job = layout.JobFiles(Path("/root"), "0" * 32)
        run = job.run(2, 1)
        made = [job.checkpoints, job.outputs, job.init, run.spec, run.pid, run.stop, run.stacks_taken]
        made += [run.launcher_log, run.setup_log, run.rank_log(3), run.rank_events(3), run.exception(3)]
        made += [run.finished(3), *run.scratch, layout.code_archive(Path("/root"), "f" * 64)]
        segments = {s for p in made for s in p.relative_to("/root").parts} - {"0" * 32}
        templates = [re.compile(re.escape(t).replace(r"\*", "[0-9a-f]+")) for t in _LAYOUT_TEMPLATES]
        unnamed = {
            s for s in segments if s not in layout.NAMES and not any(t.fullmatch(s) for t in templates)
        }
        assert unnamed == set(), f"names the layout makes that the rule does not know: {unnamed}"


# The submit gate (service/jobs/submit.py): what every new job must pass is decided there, once.
GATE_MODULE = "service.jobs.submit"
GATE = f"{GATE_MODULE}:gate"
JOB_INSERT = "service.jobs.repository:insert_job"
# What the gate composes: called from anywhere else, a caller could run part of it and skip the rest.
GATE_PARTS = {
    "service.scheduling.queue:check_priority",
    "service.scheduling.queue:check_queue_cap",
    "service.jobs.init_from:row_values",
}
GATE_PART_MODULES = {"service.jobs.policy"}


def _aliases(tree: ast.Module, module: str, sources: dict[str, str]) -> dict[str, str]:
    """Each name `module`'s imports bind: to a module of `sources`, or to `module:name` imported from one."""
    # The package a relative import starts from: the module itself when it is a package (an __init__).
    is_package = any(other.startswith(module + ".") for other in sources)
    package = module if is_package else module.rpartition(".")[0]
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, *([base] if base else [])])
            for a in node.names:
                full = f"{base}.{a.name}"
                aliases[a.asname or a.name] = full if full in sources else f"{base}:{a.name}"
    return aliases


def _resolve(
    node: ast.expr, *, module: str, aliases: dict[str, str], own: set[str], sources: set[str]
) -> str | None:
    """The function of ours (`module:name`) that a name or dotted name refers to, if one."""
    chain: list[str] = []
    while isinstance(node, ast.Attribute):
        chain.insert(0, node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    head = aliases.get(node.id)
    if head is None:
        return f"{module}:{node.id}" if node.id in own and not chain else None
    if ":" in head:
        return None if chain else head
    # A module: `repository.insert_job`, or `service.jobs.repository.insert_job` after `import service...`.
    owner = ".".join([head, *chain[:-1]])
    return f"{owner}:{chain[-1]}" if chain and owner in sources else None


def _references(sources: dict[str, str]) -> dict[str, set[str]]:
    """For each function of `sources` (`module:name`, `module:Class.name`), every function of ours it names.

    A name counts whether called or passed along (a callback runs it too); a nested function's
    names count for the function around it. Resolved through each module's imports, relative ones
    included; a name not resolved to one of `sources` (the standard library, a method on an
    object) is left out.
    """
    found: dict[str, set[str]] = {}
    for module, text in sources.items():
        tree = ast.parse(text)
        aliases = _aliases(tree, module, sources)
        defs = (ast.FunctionDef, ast.AsyncFunctionDef)
        own = {n.name for n in tree.body if isinstance(n, (*defs, ast.ClassDef))}

        def named(
            body: ast.AST, module: str = module, aliases: dict[str, str] = aliases, own: set[str] = own
        ) -> set[str]:
            loads = [
                n
                for n in ast.walk(body)
                if isinstance(n, (ast.Name, ast.Attribute)) and isinstance(n.ctx, ast.Load)
            ]
            names = (
                _resolve(n, module=module, aliases=aliases, own=own, sources=set(sources)) for n in loads
            )
            return {n for n in names if n is not None}

        for node in tree.body:
            if isinstance(node, defs):
                found[f"{module}:{node.name}"] = named(node)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, defs):
                        found[f"{module}:{node.name}.{item.name}"] = named(item)
    return found


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), set()) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def submit_gate_violations(sources: dict[str, str]) -> list[str]:
    """Every breach of the submit gate's rules in `sources` (module name -> source text), as sentences."""
    graph = _references(sources)
    found: list[str] = []
    for fn, names in sorted(graph.items()):
        module = fn.split(":")[0]
        if JOB_INSERT in names and module != GATE_MODULE:
            found.append(f"{fn} inserts a job row: only {GATE_MODULE} may (through its gate)")
        elif JOB_INSERT in names and GATE not in names:
            found.append(f"{fn} inserts a job row without asking {GATE} first")
        parts = {n for n in names if n in GATE_PARTS or n.split(":")[0] in GATE_PART_MODULES}
        if parts and module not in {GATE_MODULE, *GATE_PART_MODULES}:
            found.append(
                f"{fn} runs part of the submit gate itself ({', '.join(sorted(parts))}): call {GATE}"
            )
    return found


def _our_sources() -> dict[str, str]:
    files = _module_files(_our_top_level_packages())
    return {module: path.read_text() for module, path in files.items()}


def test_only_the_submit_gate_inserts_jobs_and_nothing_else_runs_its_parts() -> None:
    found = submit_gate_violations(_our_sources())
    assert found == [], "\n".join(found)


def test_every_way_a_job_is_made_goes_through_the_gate() -> None:
    # The routes and the driver that make jobs, found by what they reach: each reaches the gate, and
    # whatever reaches the insert is among them (a new way to make a job shows up here).
    graph = _references(_our_sources())
    makers = {"service.jobs.router:submit_job", "service.sweeps.driver:run_once"}
    checked = {"service.sweeps.router:create_sweep"}  # a sweep's submit makes no job yet: it asks the gate
    for fn in sorted(makers | checked):
        assert fn in graph, f"{fn} is gone: say here what makes jobs now"
        assert GATE in _reaches(graph, fn), f"{fn} never reaches {GATE}"
    entry_points = {fn for fn in graph if fn.split(":")[0].endswith("router")} | {
        "service.sweeps.driver:run_once"
    }
    inserting = {fn for fn in entry_points if JOB_INSERT in _reaches(graph, fn)}
    assert inserting == makers, f"routes that insert jobs: {sorted(inserting)}, expected {sorted(makers)}"


def test_the_gate_takes_the_settings_always() -> None:
    # `settings=None` used to mean "skip the server's checks": no argument of the gate may skip any.
    import inspect

    from service.jobs import submit

    for fn in (submit.gate, submit.submit):
        settings = inspect.signature(fn).parameters["settings"]
        assert settings.kind is inspect.Parameter.KEYWORD_ONLY and settings.default is inspect.Parameter.empty
        assert settings.annotation == "Settings", f"{fn.__name__}'s settings: {settings.annotation}"


class TestTheSubmitGateChecker:
    """The checker above finds what it is there to find, in small sources written to break a rule."""

    REPOSITORY = "def insert_job(session, *, values): ...\n"
    POLICY = "def check_user_code(session, *, user, spec, settings): ...\n"
    GATE_SOURCE = (
        "from service.jobs import policy, repository\n"
        "def gate(session, *, user, spec, settings):\n"
        "    policy.check_user_code(session, user=user, spec=spec, settings=settings)\n"
        "def submit(session, *, user, spec, settings):\n"
        "    gate(session, user=user, spec=spec, settings=settings)\n"
        "    return repository.insert_job(session, values={})\n"
    )

    def sources(self, **extra: str) -> dict[str, str]:
        return {
            "service.jobs.repository": self.REPOSITORY,
            "service.jobs.policy": self.POLICY,
            GATE_MODULE: self.GATE_SOURCE,
            **{name.replace("__", "."): text for name, text in extra.items()},
        }

    def test_a_house_that_keeps_the_rules_passes(self) -> None:
        router = (
            "from service.jobs import submit\n"
            "def submit_job(s, u, spec, st):\n"
            "    submit.submit(s, user=u, spec=spec, settings=st)\n"
        )
        sources = self.sources(service__jobs__router=router)
        assert submit_gate_violations(sources) == []
        assert GATE in _reaches(_references(sources), "service.jobs.router:submit_job")

    def test_an_insert_outside_the_gate_module_is_found_however_imported(self) -> None:
        for text in (
            "from service.jobs import repository\ndef start(s):\n    repository.insert_job(s, values={})\n",
            "from service.jobs.repository import insert_job as put\ndef start(s):\n    put(s, values={})\n",
            "import service.jobs.repository\ndef start(s):\n    service.jobs.repository.insert_job(s)\n",
            "from ..jobs import repository as r\ndef start(s):\n    run(r.insert_job)\n",
        ):
            found = submit_gate_violations(self.sources(service__sweeps__driver=text))
            assert found == [
                f"service.sweeps.driver:start inserts a job row: only {GATE_MODULE} may (through its gate)"
            ], text

    def test_an_insert_in_the_gate_module_that_skips_the_gate_is_found(self) -> None:
        sneaky = (
            self.GATE_SOURCE + "def quick(session):\n    return repository.insert_job(session, values={})\n"
        )
        found = submit_gate_violations({**self.sources(), GATE_MODULE: sneaky})
        assert found == [f"{GATE_MODULE}:quick inserts a job row without asking {GATE} first"]

    def test_a_caller_running_a_check_of_the_gate_itself_is_found(self) -> None:
        router = (
            "from service.jobs import policy\n"
            "async def submit_job(s, u, spec, st):\n"
            "    def accept(s):\n"
            "        policy.check_user_code(s, user=u, spec=spec, settings=st)\n"
            "    return accept(s)\n"
        )
        found = submit_gate_violations(self.sources(service__jobs__router=router))
        assert found == [
            "service.jobs.router:submit_job runs part of the submit gate itself "
            f"(service.jobs.policy:check_user_code): call {GATE}"
        ]


def test_sweeps_never_write_a_trials_status() -> None:
    # A trial's status is its job's: the trial row has no column for one, and the sweeps' code moves
    # no state but a sweep's own, in its lifecycle module, by one guarded UPDATE.
    from service.models import SweepTrial

    columns = set(SweepTrial.__table__.columns.keys())
    assert not columns & {"state", "status"}, f"sweep_trials stores a status again: {sorted(columns)}"
    lifecycle = ROOT / "service" / "sweeps" / "lifecycle.py"
    writes: list[str] = []
    for path in sorted((ROOT / "service" / "sweeps").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets for t in ast.walk(target)]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            writes += [
                where for t in targets if isinstance(t, ast.Attribute) and t.attr in ("state", "status")
            ]
            is_update = isinstance(node, ast.Call) and getattr(node.func, "id", None) == "update"
            if is_update and path != lifecycle:
                writes.append(f"{where}: update()")
    assert writes == [], f"status or state written outside service/sweeps/lifecycle.py: {writes}"


# Who the ranks run as is decided once per attempt (workers/sandbox/rank_setup.ranks_user) and
# passed along as a RunAs: making one, leasing a uid, picking nobody or asking whether the worker is
# root anywhere else in workers/ decides it again.
RANKS_USER_DECIDER = "workers/sandbox/rank_setup.py"
RANKS_USER_CALLS = {
    "RunAs",
    "RunAs.named",
    "RunAs.leased",
    "rank_uids.leased",
    "rank_uids.acquire_shared",
    "leased",
    "acquire_shared",
    "bubblewrap.nobody",
    "nobody",
}
# bubblewrap's probe tries the sandbox as nobody under a root worker, a stand-in for whichever
# unprivileged user ranks_user later picks: it says whether this host can sandbox, for no attempt.
RANKS_USER_STAND_INS = {("workers/sandbox/bubblewrap.py", "unavailable")}


def _ranks_user_decisions(source: str) -> list[tuple[str, str]]:
    """(enclosing function, what) for each place in `source` that decides who the ranks run as."""
    found: list[tuple[str, str]] = []

    def is_root_check(node: ast.Compare) -> bool:
        sides = [node.left, *node.comparators]
        asks = any(
            isinstance(s, ast.Call)
            and ast.unparse(s.func) in {"os.getuid", "os.geteuid", "getuid", "geteuid"}
            for s in sides
        )
        return asks and any(isinstance(s, ast.Constant) and s.value == 0 for s in sides)

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call) and (callee := ast.unparse(node.func)) in RANKS_USER_CALLS:
            found.append((function, f"{callee}()"))
        if isinstance(node, ast.Compare) and is_root_check(node):
            found.append((function, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "<module>")
    return found


def test_only_rank_setup_decides_who_the_ranks_run_as() -> None:
    decided = {
        (rel, function, what)
        for path in sorted((ROOT / "workers").rglob("*.py"))
        if (rel := str(path.relative_to(ROOT))) != RANKS_USER_DECIDER
        for function, what in _ranks_user_decisions(path.read_text())
    }
    again = sorted(d for d in decided if d[:2] not in RANKS_USER_STAND_INS)
    assert again == [], f"who the ranks run as is decided again outside {RANKS_USER_DECIDER}: {again}"
    decider = _ranks_user_decisions((ROOT / RANKS_USER_DECIDER).read_text())
    assert {f for f, _ in decider} == {"ranks_user"}, f"ranks_user alone decides: {decider}"


def test_the_ranks_user_rule_catches_a_second_decision() -> None:
    # How the environment's installer once chose its user for itself, and how a launcher might.
    again = """
def enter(setup, settings):
    run_as = setup.run_as
    uid = run_as.uid if run_as is not None and os.getuid() == 0 else None
    return RunAs.named(settings.run_as) if settings.run_as else uid

def user(hold, settings):
    return hold.enter_context(rank_uids.leased(settings.rank_uids)) if os.geteuid() != 0 else nobody()
"""
    assert _ranks_user_decisions(again) == [
        ("enter", "os.getuid() == 0"),
        ("enter", "RunAs.named()"),
        ("user", "os.geteuid() != 0"),
        ("user", "rank_uids.leased()"),
        ("user", "nobody()"),
    ]
