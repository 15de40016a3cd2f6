"""engine.compile: torch.compile as torch documents it for DDP, and a check that its backend can run.

What is compiled is the model's own `forward`, in place, inside DDP. DDP's forward runs eagerly (dynamo
skips torch.nn.parallel) and marks itself the active DDP module while it calls the model; dynamo,
compiling the model's forward then, goes through DDPOptimizer, which splits the graph at DDP's bucket
boundaries so each bucket's allreduce starts while the rest of the backward runs (torch's DDP notes,
"TorchDynamo DDPOptimizer"; torch.compiler FAQ, "Do you support Distributed code?"). One graph for the
whole model would fire every gradient hook only after the whole backward: no overlap.

Why `forward` and not the module: torch documents both `torch.compile(DDP(model))` (DDP notes) and
`model.compile(); DDP(model)` ("Where to apply torch.compile?"), and in torch 2.13 both compile
nothing, silently, when the model's forward is torch's own code (an nn.Sequential, the `mlp`
recipe): dynamo skips torch's frames, and Module.compile compiles `_call_impl`, which torch exempts
from the wrapper that would give such a forward a frame to capture. torch.compile of the bound
`forward` gets that wrapper, so every model compiles; state_dict keys and the module's class stay.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rank_contract.failures import Failure, named

# Triton cannot compile for GPUs below this CUDA capability (torch._inductor.exc.GPUTooOldForTriton).
_TRITON_MIN_CAPABILITY = (7, 0)
# How long `CXX --version` may take: torch runs the same probe, without a limit, on first compile.
_PROBE_TIMEOUT_S = 30
_MB = 1024 * 1024  # DDP's bucket_cap_mb unit (it multiplies by 2**20)


@named(Failure.COMPILE_UNAVAILABLE)
class CompileUnavailable(RuntimeError):
    """engine.compile asks for a backend this worker cannot run; the message names what is missing."""


def check_backend(backend: str, device: torch.device) -> None:
    """Raise CompileUnavailable unless torch.compile with `backend` can run on `device` here."""
    # At job start: otherwise the first step fails, after the rendezvous and the model build, deep
    # inside a compile, with a traceback that names neither the spec field nor the fix.
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        free_threaded = " (free-threaded build)" if sysconfig.get_config_var("Py_GIL_DISABLED") else ""
        raise CompileUnavailable(
            f"engine.compile: torch {torch.__version__} does not support torch.compile on Python "
            f"{sys.version.split()[0]}{free_threaded}; run this job with engine.compile false, or on a "
            "worker whose Python this torch supports"
        )
    # exclude_tags=(): the default hides backends tagged "debug", and aot_eager and eager are.
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        raise CompileUnavailable(
            f"engine.compile_backend {backend!r} is not a torch.compile backend in torch {torch.__version__} "
            f"(it has: {', '.join(sorted(known))})"
        )
    if backend != "inductor":
        return  # eager and aot_eager run the traced graphs with torch's own kernels: nothing to build
    if device.type == "cuda":
        _check_triton(device)
    else:
        _check_python_headers()
        _check_cxx()


def _cxx_candidates() -> list[str]:
    """The compilers inductor tries, in its order: torch._inductor.config.cpp.cxx (from $CXX, else g++)."""
    from torch._inductor import config as inductor_config

    cxx = inductor_config.cpp.cxx
    search = cxx if isinstance(cxx, (list, tuple)) else (cxx,)
    # A None entry means "download gcc from conda-forge", which torch does only when
    # TORCH_INDUCTOR_INSTALL_GXX is set (torch._inductor.cpp_builder.cpp_compiler_search).
    return [c for c in search if c]


def _check_cxx() -> None:
    """Inductor on CPU writes C++ kernels and builds them with the first compiler that answers --version."""
    tried = []
    for name in _cxx_candidates():
        path = shutil.which(name)  # a bare name through PATH, a path as is; None unless executable
        if path is None:
            tried.append(f"{name} (not found or not executable)")
            continue
        try:
            # The same probe torch makes (cpp_compiler_search): a compiler that cannot run this
            # cannot build a kernel either.
            subprocess.run(
                [path, "--version"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=_PROBE_TIMEOUT_S,
            )
            return
        except (OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{path} (`--version` failed: {exc})")
    if os.environ.get("TORCH_INDUCTOR_INSTALL_GXX"):
        return  # torch will fetch gcc through conda itself; if that fails its own error says so
    raise CompileUnavailable(
        "engine.compile_backend 'inductor' on CPU needs a working C++ compiler, and none was found: "
        f"tried {', '.join(tried) or 'nothing (torch._inductor.config.cpp.cxx is empty)'}. Install g++ "
        "on the worker (Debian/Ubuntu: apt-get install g++) or point the CXX environment variable at "
        "one; or use compile_backend 'aot_eager', which needs no compiler"
    )


def _check_python_headers() -> None:
    """Inductor's CPU kernels are Python extension modules: they include Python.h."""
    if not sys.platform.startswith("linux"):
        return  # torch looks elsewhere for a macOS framework's headers; workers run Linux
    include = Path(sysconfig.get_path("include"))
    if not (include / "Python.h").exists():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise CompileUnavailable(
            f"engine.compile_backend 'inductor' on CPU needs the Python development headers, and "
            f"{include / 'Python.h'} is missing: install them (Debian/Ubuntu: apt-get install "
            f"python{version}-dev) or use compile_backend 'aot_eager'"
        )


def _check_triton(device: torch.device) -> None:
    """Inductor on CUDA writes Triton kernels: Triton must import, the GPU be new enough, and C build."""
    if importlib.util.find_spec("triton") is None:
        raise CompileUnavailable(
            "engine.compile_backend 'inductor' on CUDA needs Triton, which is not installed: install the "
            f"triton version torch {torch.__version__} was built with (the CUDA wheels of torch depend on "
            "it), or use compile_backend 'aot_eager'"
        )
    try:
        import triton  # noqa: F401
    except Exception as exc:
        raise CompileUnavailable(
            f"engine.compile_backend 'inductor' on CUDA needs Triton, which fails to import: {exc!r}"
        ) from exc
    capability = torch.cuda.get_device_capability(device)
    if capability < _TRITON_MIN_CAPABILITY:
        raise CompileUnavailable(
            f"engine.compile_backend 'inductor' on CUDA needs a GPU of compute capability >= 7.0 for "
            f"Triton; {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: use "
            "compile_backend 'aot_eager'"
        )
    # Triton builds its launcher stubs with a C compiler: $CC, else gcc, else clang on PATH
    # (triton/runtime/build.py), at the first kernel launch.
    cc = os.environ.get("CC")
    found = shutil.which(cc) if cc else shutil.which("gcc") or shutil.which("clang")
    if found is None:
        what = f"CC={cc!r} is not an executable" if cc else "neither gcc nor clang is on PATH"
        raise CompileUnavailable(
            f"engine.compile_backend 'inductor' on CUDA needs a C compiler for Triton's launchers: {what}. "
            "Install gcc on the worker or point CC at one"
        )


def check_compile(*, backend: str, bucket_cap_mb: float, device: torch.device, world_size: int) -> None:
    """Refuse, at job start, an engine.compile job that would fail at its first step."""
    check_backend(backend, device)
    if world_size > 1 and int(bucket_cap_mb * _MB) < dist._DEFAULT_FIRST_BUCKET_BYTES:
        # DDPOptimizer (torch/_dynamo/backends/distributed.py) asserts that DDP's first bucket (1 MiB)
        # is no larger than the others, and fails the first forward with a bare AssertionError.
        raise ValueError(
            f"engine.compile with engine.bucket_cap_mb {bucket_cap_mb}: torch.compile's DDPOptimizer "
            f"needs buckets of at least {dist._DEFAULT_FIRST_BUCKET_BYTES / _MB:g} MiB (DDP's first bucket)"
        )


def compile_model(module: nn.Module, backend: str | Callable[..., Any]) -> nn.Module:
    """Compile `module`'s forward in place with `backend` (wrap it in DDP before or after); returns it."""
    # torch's defaults otherwise: mode "default" (no CUDA graphs, which "reduce-overhead" would add,
    # with static-address and memory costs of their own), fullgraph=False (a user model with code
    # dynamo cannot trace runs that part eagerly instead of failing), dynamic=None (fixed shapes; a
    # shape that changes, such as an uneven last eval batch, recompiles once with dynamic shapes).
    # An instance attribute, like torch's own Module.compile: the class, its hooks (run eagerly
    # around it) and the state_dict keys stay those of the bare module, so checkpoints do not change.
    module.forward = torch.compile(module.forward, backend=backend)  # type: ignore[method-assign]
    return module
