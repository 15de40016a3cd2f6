"""engine.compile: compiled matches eager, DDP's graph splits at buckets, a missing backend fails clearly."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.engine_fixtures import EngineRun, Launches
from workers.attempt.end import NOT_RETRIED
from workers.engine import compile as C

# Compiled vs eager after the equivalence job's 10 steps (max |param diff|), measured on CPU: inductor
# at world 1 1.5e-8 (its fused C++ loops sum the bias gradients over the batch in another order than
# torch's kernels: same math, other float rounding, carried on by momentum); aot_eager at world 2 0
# (torch's own kernels, run from the traced graphs). The bound is the cross-world-size one
# (test_equivalence): compiling may reorder float operations no more than splitting the batch does.
COMPILE_TOLERANCE = 1e-6
# The world-2 job: three 640-wide layers (1.6 MiB each) in 1 MiB buckets, so DDP has several buckets
# and DDPOptimizer must split the compiled graph between them.
BUCKETED = {"hyperparameters": {"hidden_size": 640}, "engine": {"bucket_cap_mb": 1.0}}
CPU = torch.device("cpu")


def _params(run: EngineRun) -> dict[str, torch.Tensor]:
    steps = max(e["step"] for e in run.events(0) if e["type"] == "metrics")
    return run.checkpoint(steps)["model"]


def _max_diff(compiled: EngineRun, eager: EngineRun) -> float:
    a, b = _params(compiled), _params(eager)
    # The bare module's names: no `_orig_mod.` (torch.compile's wrapper) or `module.` (DDP's) prefix.
    assert a.keys() == b.keys(), f"expected the eager run's parameter names {sorted(b)}, got {sorted(a)}"
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.e2e
def test_inductor_at_world_1_matches_eager(launched: Launches, make_spec: Callable[..., Any]) -> None:
    eager = launched.torchrun(make_spec(), 1)  # the equivalence job's reference, shared
    # graph_code: dynamo logs each graph it captured, which shows the model really was compiled (an
    # nn.Sequential whose forward is torch's own code is silently not, done the usual ways: compile.py).
    compiled = launched.torchrun(
        make_spec(engine={"compile": True}), 1, extra_env={"TORCH_LOGS": "graph_code"}
    )
    assert "TRACED GRAPH" in compiled.log(0), f"expected dynamo to capture the model\n{compiled.describe()}"
    diff = _max_diff(compiled, eager)
    print(f"inductor @ world 1 vs eager: max |param diff| = {diff:.3g}")
    assert diff <= COMPILE_TOLERANCE, f"expected max |param diff| <= {COMPILE_TOLERANCE}, got {diff:.3g}"


@pytest.mark.e2e
def test_aot_eager_under_ddp_splits_at_buckets_and_matches_eager(
    launched: Launches, make_spec: Callable[..., Any]
) -> None:
    eager = launched.torchrun(make_spec(BUCKETED), 2)
    compiled = launched.torchrun(
        make_spec(BUCKETED, engine={"compile": True, "compile_backend": "aot_eager"}),
        2,
        extra_env={"TORCH_LOGS": "ddp_graphs"},
    )
    for rank in (0, 1):
        log = compiled.log(rank)
        # DDPOptimizer logs the graph it split, one submodule per bucket: proof that the compiled
        # forward ran inside DDP's and that its gradients can be allreduced bucket by bucket.
        split = log.partition("---split graph---")[2].partition("---submod_0 graph---")[0]
        buckets = split.count("call_module[target=submod_")
        assert buckets >= 2, f"rank {rank}: expected the graph split into >= 2 buckets, got {buckets}\n{log}"
    diff = _max_diff(compiled, eager)
    print(f"aot_eager @ world 2 vs eager @ world 2: max |param diff| = {diff:.3g}")
    assert diff <= COMPILE_TOLERANCE, f"expected max |param diff| <= {COMPILE_TOLERANCE}, got {diff:.3g}"


@pytest.mark.e2e
def test_missing_compiler_fails_the_job_naming_it(engine_runner: Any, make_spec: Callable[..., Any]) -> None:
    run = engine_runner(make_spec(engine={"compile": True}), 1, extra_env={"CXX": "/nonexistent/g++"})
    assert run.returncode != 0, f"expected the job to fail\n{run.describe()}"
    errors = [e for e in run.events(0) if e["type"] == "error"]
    assert len(errors) == 1, f"expected one error event, got {run.events(0)}\n{run.describe()}"
    err = errors[0]
    assert err["error_type"] == "CompileUnavailable", f"unexpected error event {err}"
    for words in ("C++ compiler", "/nonexistent/g++", "CXX", "aot_eager"):
        assert words in err["message"], f"expected the message to name {words!r}, got {err['message']!r}"
    assert "/nonexistent/g++" in run.log(0), f"expected the rank log to name the compiler\n{run.describe()}"
    assert not any(e["type"] in ("started", "metrics") for e in run.events(0)), "expected no step to run"
    assert "CompileUnavailable" in NOT_RETRIED, "a worker without the backend fails a restart the same way"


# ---- check_backend and compile_model, in process ------------------------------------------------------


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(C.CompileUnavailable, match="'no_such_backend' is not a torch.compile backend"):
        C.check_backend("no_such_backend", CPU)


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_backends_without_a_compiler_pass(backend: str) -> None:
    C.check_backend(backend, CPU)


def test_inductor_on_cpu_needs_a_cxx_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torch._inductor import config as inductor_config

    not_executable = tmp_path / "g++"
    not_executable.write_text("#!/bin/sh\n")  # there, but without the x bit
    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/g++", str(not_executable)))
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    with pytest.raises(C.CompileUnavailable, match="needs a working C\\+\\+ compiler") as caught:
        C.check_backend("inductor", CPU)
    for words in ("/nonexistent/g++ (not found or not executable)", str(not_executable), "CXX", "aot_eager"):
        assert words in str(caught.value), f"expected {words!r} in {caught.value}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the headers are looked for on Linux only")
def test_inductor_on_cpu_needs_python_headers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = C.sysconfig.get_path
    monkeypatch.setattr(
        C.sysconfig,
        "get_path",
        lambda name, *a, **kw: str(tmp_path) if name == "include" else real(name, *a, **kw),
    )
    with pytest.raises(C.CompileUnavailable, match="Python development headers") as caught:
        C.check_backend("inductor", CPU)
    assert str(tmp_path / "Python.h") in str(caught.value), f"expected the missing path in {caught.value}"


def test_inductor_on_cuda_needs_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    real = C.importlib.util.find_spec
    monkeypatch.setattr(
        C.importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    with pytest.raises(C.CompileUnavailable, match="needs Triton, which is not installed"):
        C.check_backend("inductor", torch.device("cuda", 0))


def test_unsupported_python_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    version = sys.version.split()[0]
    with pytest.raises(C.CompileUnavailable, match=f"on Python {version}.*engine.compile false"):
        C.check_backend("eager", CPU)


def test_ddp_buckets_under_1_mib_are_refused_with_compile() -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb 0.5.*at least 1 MiB"):
        C.check_compile(backend="aot_eager", bucket_cap_mb=0.5, device=CPU, world_size=2)
    C.check_compile(backend="aot_eager", bucket_cap_mb=1.0, device=CPU, world_size=2)
    C.check_compile(backend="aot_eager", bucket_cap_mb=0.5, device=CPU, world_size=1)  # no DDP, no buckets


def test_compile_model_compiles_a_sequential_in_place() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    keys = list(model.state_dict())
    x = torch.randn(3, 4)
    expected = model(x)
    try:
        assert C.compile_model(model, counting) is model
        assert torch.equal(model(x), expected), "expected the compiled forward to compute the same output"
        assert len(graphs) == 1, f"expected one graph of the Sequential's forward, got {len(graphs)}"
    finally:
        torch.compiler.reset()  # no cache entries on Sequential.forward left to other tests
    assert type(model) is nn.Sequential and list(model.state_dict()) == keys, "expected the bare module kept"
