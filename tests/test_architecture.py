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


def _top_level_imports(path: Path) -> set[str]:
    """The packages a module imports outside any function, so on its own import."""
    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text())]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return found


def test_the_cli_reaches_the_server_only_through_dptrain_server_on_demand() -> None:
    # `pip install dptrain` is the client: its CLI package never imports the service or the worker,
    # even inside a function; the server's commands live in dptrain_server, which the CLI loads
    # only when one of them is asked for (dptrain_cli/lazy.py).
    server = {"service", "workers"}
    anywhere = {f: m & server for f, m in _imports(ROOT / "dptrain_cli").items() if m & server}
    assert anywhere == {}, f"dptrain_cli must not import {server}: {anywhere}"
    eager = [str(p.relative_to(ROOT)) for p in (ROOT / "dptrain_cli").rglob("*.py")]
    eager = [f for f in eager if "dptrain_server" in _top_level_imports(ROOT / f)]
    assert eager == [], f"dptrain_cli must import dptrain_server inside functions only: {eager}"


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


def _module_strings(tree: ast.Module) -> dict[str, str]:
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
    strings = _module_strings(tree)
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
