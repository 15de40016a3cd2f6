"""What the API accepts is exactly what the engine runs: a property over generated specs.

Specs are drawn from the JSON schema of the models themselves (types, bounds, enums, patterns), so
a field added to `JobSpec` or to a recipe's parameters is generated without touching this file:
mostly valid values, and at every field also values just past its bounds, of another JSON type,
non-finite, beyond 64 bits, or nested far too deep. For each one:

- the API never answers 5xx;
- a spec the API accepts builds the engine's configuration at its world size, from what the job
  stores (the runner writes that as the rank's spec.json); a command job, which the engine does
  not run, validates again from what it stores (placement and the job's page read that);
- a spec the engine's construction refuses is refused by the API with 422, and the other way
  round, but for the one rule the engine leaves to the server (DPTRAIN_ALLOWED_ENTRYPOINTS).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from api_schemas import RECIPES, JobSpec
from api_schemas.data import RECIPE_DATA_KINDS
from service.config import Settings
from workers.engine.config import configure
from workers.engine.recipes import builder_of, plan_params

ALLOWED_PREFIXES = ("examples", "team")
SCHEMA = JobSpec.model_json_schema()
INT64 = 2**63
# The schema of each kind of data source (`data.train`, `data.eval`), by its `kind`.
SOURCES = {
    d["properties"]["kind"]["const"]: d
    for d in SCHEMA["$defs"].values()
    if "const" in d.get("properties", {}).get("kind", {})
}


@dataclass(frozen=True)
class Raw:
    """JSON text spliced into the body as is: what json.dumps cannot write (deep nesting, 1e999)."""

    text: str

    def __repr__(self) -> str:
        return f"Raw({self.text[:20]!r}{'...' if len(self.text) > 20 else ''} {len(self.text)} chars)"


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _bounds(schema: dict[str, Any], lo: int, hi: int) -> tuple[int, int]:
    lo = schema.get("minimum", schema["exclusiveMinimum"] + 1 if "exclusiveMinimum" in schema else lo)
    hi = schema.get("maximum", schema["exclusiveMaximum"] - 1 if "exclusiveMaximum" in schema else hi)
    return int(lo), int(hi)


def _branches(schema: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The alternatives of a union: `anyOf`, or `oneOf` (a discriminated union such as a data source)."""
    return schema.get("anyOf", schema.get("oneOf"))


def valid(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values the schema allows, small ones preferred (so batch sizes and world sizes often divide)."""
    schema = _resolve(schema, defs)
    if (branches := _branches(schema)) is not None:
        return st.one_of([valid(s, defs) for s in branches])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        lo, hi = _bounds(schema, -INT64, INT64 - 1)
        return st.one_of(st.integers(lo, min(hi, lo + 3)), st.sampled_from([lo, hi]), st.integers(lo, hi))
    if kind == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        below = "exclusiveMaximum" in schema  # e.g. momentum < 1
        floats = st.floats(
            lo,
            hi,
            exclude_min="exclusiveMinimum" in schema,
            exclude_max=below,
            allow_nan=False,
            allow_infinity=False,
        )
        whole = [
            n
            for n in (1, 2, 10)
            if (lo is None or n > lo) and (hi is None or n < hi or n == hi and not below)
        ]
        return floats | st.sampled_from(whole) if whole else floats  # JSON writes 2.0 as 2 too
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        lo, hi = schema.get("minItems", 0), schema.get("maxItems", 4)
        return st.lists(valid(schema.get("items", {}), defs), min_size=lo, max_size=max(lo, min(hi, 4)))
    if kind == "string":
        if "pattern" in schema:
            lo, hi = schema.get("minLength", 1), schema.get("maxLength", 64)
            return st.from_regex(schema["pattern"], fullmatch=True).filter(lambda s: lo <= len(s) <= hi)
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 32), 32))
    if kind == "object":
        props = schema.get("properties", {})
        if "patternProperties" in schema:  # a map (labels): keys of the pattern, within the length bounds
            (pattern, values), *_ = schema["patternProperties"].items()
            names = valid({"type": "string", "pattern": pattern, **schema.get("propertyNames", {})}, defs)
            return st.dictionaries(names, valid(values, defs), max_size=3)
        return st.fixed_dictionaries(
            {k: valid(v, defs) for k, v in props.items() if k in schema.get("required", [])},
            optional={k: valid(v, defs) for k, v in props.items() if k not in schema.get("required", [])},
        )
    return st.integers(-3, 3) | st.text(max_size=8) | st.lists(st.integers(0, 3), max_size=3)


def invalid(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values the schema refuses: past a bound, another JSON type, non-finite, beyond 64 bits, deep."""
    schema = _resolve(schema, defs)
    if (branches := _branches(schema)) is not None:
        return st.one_of([invalid(s, defs) for s in branches if _resolve(s, defs).get("type") != "null"])
    hostile = st.sampled_from(
        [Raw("1e999"), Raw("NaN"), Raw("-Infinity"), 2**64, -(2**70), [[[]]], Raw("[" * 5000 + "]" * 5000)]
    )
    kind = schema.get("type")
    if "enum" in schema or "const" in schema:
        return hostile | st.sampled_from(["bogus", 1, None, True])
    if kind == "integer":
        lo, hi = _bounds(schema, -INT64, INT64 - 1)
        return hostile | st.sampled_from([lo - 1, hi + 1, True, "5", 5.0, 2.5, None, {}])
    if kind == "number":
        edges = (
            schema.get("exclusiveMinimum"),
            schema.get("exclusiveMaximum"),
            schema.get("minimum", 0) - 1,
            schema.get("maximum", 0) + 1,
        )
        return hostile | st.sampled_from([v for v in edges if v is not None] + [True, "0.5", None, []])
    if kind == "string":
        return hostile | st.sampled_from(["", "has space", "ok\n", "x" * 300, 5, None, ["a"]])
    if kind == "boolean":
        return hostile | st.sampled_from([1, 0, "true", None])
    return hostile | st.sampled_from(["x", [], 3, None, {"unknown_option": 1}])


def fields_of(schema: dict[str, Any], defs: dict[str, Any], path: tuple[str, ...] = ()) -> list[Any]:
    """(path, schema) of every field of an object schema, nested objects' fields included (those of
    each object a union may be too, such as a data source's `path`)."""
    out: list[Any] = []
    for name, sub in schema.get("properties", {}).items():
        out.append(((*path, name), sub))
        resolved = _resolve(sub, defs)
        for option in _branches(resolved) or [resolved]:
            option = _resolve(option, defs)
            if (branches := _branches(option)) is not None:  # a nullable discriminated union
                for inner in branches:
                    out += fields_of(_resolve(inner, defs), defs, (*path, name))
            elif option.get("type") == "object" and "properties" in option:
                out += fields_of(option, defs, (*path, name))
    return out


@st.composite
def specs(draw: st.DrawFn) -> Any:
    """A submit body: a valid spec, often with one or two fields then spoilt, now and then no object."""
    defs = SCHEMA["$defs"]
    spec: dict[str, Any] = draw(valid(SCHEMA, defs))
    for key in ("recipe", "entrypoint", "command"):
        spec.pop(key, None)
    # The cross-field rules need related values to meet: exactly one of recipe, entrypoint and
    # command, a recipe's own extras, allowed entrypoint modules, a batch that splits, data options
    # and sources that fit the job.
    hp = spec.setdefault("hyperparameters", {})
    fields = fields_of(SCHEMA, defs)
    kind = draw(st.sampled_from(["recipe"] * 5 + ["entrypoint"] * 2 + ["command"] * 2))
    if kind == "recipe":
        spec["recipe"] = recipe = draw(st.sampled_from(sorted(RECIPES)))
        extras = RECIPES[recipe].model_json_schema()
        hp.update(draw(valid(extras, {})))
        fields += fields_of(extras, {}, ("hyperparameters",))
    elif kind == "entrypoint":
        module = draw(st.from_regex(r"[a-z][a-z0-9_]{0,8}(\.[a-z][a-z0-9_]{0,8}){0,2}", fullmatch=True))
        prefix = draw(st.sampled_from([*ALLOWED_PREFIXES, "elsewhere"]))
        spec["entrypoint"] = f"{prefix}.{module}:{draw(st.sampled_from(['build', 'plan']))}"
    else:
        command = next(s for s in SCHEMA["properties"]["command"]["anyOf"] if s.get("type") == "array")
        spec["command"] = draw(valid(command, defs))
        if draw(st.integers(0, 3)):  # this server holds no code archive: a command's code is a 422
            spec.pop("code", None)
    if kind != "recipe":
        hp.update(
            draw(st.dictionaries(st.sampled_from(["features", "layers", "data"]), valid({}, {}), max_size=2))
        )
    if draw(st.integers(0, 3)):
        fit_data(spec, draw)
    res = spec.get("resources", {})
    world = res.get("nodes", 1) * res.get("processes_per_node", 1)
    accum = spec.get("engine", {}).get("grad_accumulation_steps", 1)
    if world * accum <= 1_000_000 and draw(st.integers(0, 3)):
        hp["global_batch_size"] = (
            world * accum * draw(st.integers(1, max(1, min(8, 1_000_000 // (world * accum)))))
        )
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2]))):
        path, schema = draw(st.sampled_from(fields))
        target = spec
        for key in path[:-1]:
            if not isinstance(target.get(key), dict):
                target[key] = {}
            target = target[key]
        target[path[-1]] = draw(invalid(schema, defs))
    return draw(st.sampled_from([spec] * 9 + [[], "spec", 3, None]))


def fit_data(spec: dict[str, Any], draw: st.DrawFn) -> None:
    """Make the spec's `data` fit its job: the sources its recipe reads (none for a command), loader
    options that need loader processes only with some, and eval data where a recipe evaluates."""
    data = spec.setdefault("data", {})
    if "command" in spec:
        spec.pop("evaluation", None)
        data.clear()
        return
    if not data.get("num_workers"):
        data.pop("prefetch_factor", None)
        data.pop("persistent_workers", None)
    if spec.get("resources", {}).get("device", "cpu") == "cpu":
        data.pop("pin_memory", None)
    recipe = spec.get("recipe")
    kinds = RECIPE_DATA_KINDS.get(recipe, ()) if recipe is not None else tuple(SOURCES)
    if kinds and data.get("train") is None and draw(st.booleans()):
        data["train"] = draw(valid(SOURCES[draw(st.sampled_from(kinds))], SCHEMA["$defs"]))
    for split in ("train", "eval"):
        source = data.get(split)
        if source is None:
            continue
        if source["kind"] not in kinds:
            data.pop(split)
        elif source["kind"] == "token_file" and recipe is not None:
            source.pop("block_size", None)  # gpt reads windows of its seq_len
        elif source["kind"] == "token_file" and source.get("block_size") is None:
            source["block_size"] = draw(st.integers(1, 4096))
    if data.get("train") is None:
        data.pop("eval", None)
    elif recipe is not None and spec.get("evaluation") is not None and data.get("eval") is None:
        data["eval"] = {**data["train"], "path": "eval"}


def to_json(value: Any) -> str:
    """JSON text of `value`, with every Raw spliced in verbatim."""
    raws: list[str] = []

    def mark(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(v, dict):
            return {k: mark(x) for k, x in v.items()}
        if isinstance(v, list):
            return [mark(x) for x in v]
        return v

    text = json.dumps(mark(value))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw)
    return text


def engine_builds(spec_json: str, world_size: int) -> JobSpec | None:
    """The engine's construction for `world_size` ranks (what a rank does first), None if it refuses.

    A command runs under torchrun without the engine, splitting its batches itself: its spec is only
    validated (as placement reads it), never configured.
    """
    try:
        spec = JobSpec.model_validate_json(spec_json)
        if spec.command is not None:
            return spec
        spec = configure(spec_json, world_size).spec
    except ValueError:  # pydantic's ValidationError is one
        return None
    plan_params(spec)
    if spec.recipe is not None:
        builder_of(spec)  # the registry has every recipe the models declare
    return spec


def requested_world(value: Any) -> int:
    """The world size a spec asks for, as the runner reads it (1 where the spec has no valid one)."""
    res = value.get("resources") if isinstance(value, dict) else None
    nodes = res.get("nodes", 1) if isinstance(res, dict) else 1
    per_node = res.get("processes_per_node", 1) if isinstance(res, dict) else 1
    ok = all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 256 for n in (nodes, per_node))
    return nodes * per_node if ok else 1


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """No rate limit nor queued cap (hypothesis posts hundreds of specs); two allowed entrypoint prefixes."""
    return settings.model_copy(
        update={
            "rate_limit_per_second": 0.0,
            "max_queued_per_user": 0,
            "allowed_entrypoints": ",".join(ALLOWED_PREFIXES),
        }
    )


@hypothesis_settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=specs())
def test_the_api_accepts_exactly_the_specs_the_engine_runs(client: TestClient, body: Any) -> None:
    text = to_json(body)

    r = client.post("/v1/jobs", content=text, headers={"Content-Type": "application/json"})
    # An init_from naming a job is checked against the server's jobs (none here): 404 once the spec is
    # valid, like an engine-built spec naming code the server does not hold.
    names_a_job = r.status_code == 404 and "init_from.job" in r.text
    assert r.status_code in (201, 422) or names_a_job, (
        f"expected 201 or 422, got {r.status_code}: {r.text[:500]}\n{text[:500]}"
    )
    if names_a_job:
        assert engine_builds(text, requested_world(body)) is not None, (
            f"404 for a spec the engine refuses: {text}"
        )
        return
    if r.status_code == 201:
        stored = r.json()["spec"]
        world = JobSpec.model_validate(stored).world_size
        assert engine_builds(json.dumps(stored), world) is not None, (
            f"accepted, but the engine refuses {stored}"
        )
    engine = engine_builds(text, requested_world(body))
    if engine is None:
        assert r.status_code == 422, (
            f"the engine refuses this spec, the API answered {r.status_code}: {text[:500]}"
        )
    elif r.status_code == 422:
        locs = [tuple(e["loc"]) for e in r.json()["detail"]]
        # What only the server knows: its allow-list, and which code archives it holds (none here).
        server_side = {
            ("body", "entrypoint"): "DPTRAIN_ALLOWED_ENTRYPOINTS",
            ("body", "code", "sha256"): "upload it first",
        }
        # And which requirement lines it installs (service/jobs/requirements.py: PEP 508, the
        # worker's own packages, pip options): the engine's model checks only their shape.
        if len(locs) == 1 and locs[0][:3] == ("body", "environment", "requirements"):
            server_side[locs[0]] = "requirement"
        assert len(locs) == 1 and server_side.get(locs[0], "\x00") in r.text, (
            f"the engine builds this spec but the API refused it: {r.text[:500]}\n{text[:500]}"
        )
