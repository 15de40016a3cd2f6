"""Which variables a job's `env` may set: an allow-list pattern, then a deny-list of what they steer.

A job's variables reach more than the user's program: torchrun, dptrain's rank supervisor, the
sandbox's launcher, and every helper a rank starts on the user's behalf (inductor and triton run a
C/C++ compiler, torch may run git or nvcc, Python runs startup hooks). A variable that steers one of
those (`CXX=/bin/bash` with `BASH_ENV=$(...)`, `LD_PRELOAD`, `GCONV_PATH`, `OPENSSL_CONF`) runs code
of the user's choosing where only a built-in recipe or an allowed entrypoint was meant to run, or
takes a resource the worker assigned to another job (`CUDA_VISIBLE_DEVICES`). The API refuses such
names at submit (422 naming the variable) and the worker drops them again from a stored spec
(workers/sandbox/rank_env.py), so the rule lives here, once, for both.

The pattern is an allow-list: upper-case letters, digits and `_`, starting with a letter, at most
128 characters. Upper case only, because several programs also read a lower-case twin
(`http_proxy`, `ld_library_path` on case-insensitive tooling) and matching names exactly keeps this
list exact; a leading letter, because leading-underscore names are the JVM's (`_JAVA_OPTIONS`) and
the shell's (`_`); no `%` or `-`, so bash's exported functions (`BASH_FUNC_name%%`) cannot be
passed. Every name a user's program reads for itself (`WANDB_MODE`, `MY_FLAG`, `HF_HUB_OFFLINE`)
fits it.
"""

from __future__ import annotations

import re

ENV_NAME_PATTERN = r"^[A-Z][A-Z0-9_]{0,127}$"

# Exact names and prefixes refused, by what they steer. A prefix ends where the family's names
# begin (`LD_` refuses `LD_PRELOAD`; the linker `LD` itself is an exact name).
DENIED_ENV_GROUPS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    # dptrain's own settings and the SDK's variables, and torchrun's wiring of the ranks: the worker
    # sets them; a user's value would point a rank at another job's files or peers.
    "dptrain and torchrun": (
        frozenset(
            {
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
                "GROUP_WORLD_SIZE",
                "ROLE_NAME",
                "ROLE_RANK",
                "ROLE_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
            }
        ),
        ("DPTRAIN_", "TORCHELASTIC_"),
    ),
    # The dynamic loader and the C library: LD_PRELOAD / LD_LIBRARY_PATH / LD_AUDIT load shared
    # objects into every process; GCONV_PATH loads iconv modules (shared objects); GLIBC_TUNABLES
    # reached root through set-uid programs (CVE-2023-4911); MALLOC_* changes the allocator's
    # checks; LOCPATH, NLSPATH, TZDIR and TERMINFO make libc and curses parse files of the user's
    # choosing; HOSTALIASES, LOCALDOMAIN and RES_OPTIONS steer the resolver.
    "loader and C library": (
        frozenset(
            {
                "GCONV_PATH",
                "GLIBC_TUNABLES",
                "LOCPATH",
                "NLSPATH",
                "TZDIR",
                "TERMINFO",
                "TERMINFO_DIRS",
                "TERMCAP",
                "HOSTALIASES",
                "LOCALDOMAIN",
                "RES_OPTIONS",
            }
        ),
        ("LD_", "MALLOC_"),
    ),
    # Shells run these at start (BASH_ENV, ENV), expand them (PS4 under `set -x`, PROMPT_COMMAND) or
    # parse with them (IFS, CDPATH, SHELLOPTS turning on xtrace); SHELL, EDITOR, VISUAL, PAGER and
    # BROWSER name programs other tools start; ZDOTDIR holds zsh's start-up files.
    "shells": (
        frozenset(
            {
                "BASH_ENV",
                "ENV",
                "SHELL",
                "SHELLOPTS",
                "BASHOPTS",
                "BASH_XTRACEFD",
                "PS1",
                "PS2",
                "PS3",
                "PS4",
                "PROMPT_COMMAND",
                "IFS",
                "CDPATH",
                "ZDOTDIR",
                "EDITOR",
                "VISUAL",
                "PAGER",
                "BROWSER",
            }
        ),
        (),
    ),
    # Compilers and build tools: inductor, triton and torch's C++ extensions build code with CC/CXX
    # and these flags; GCC_EXEC_PREFIX and COMPILER_PATH say where gcc finds its own subprograms;
    # the NVCC_* flags and CUDAHOSTCXX reach nvcc; MAKEFLAGS reaches make.
    "compilers": (
        frozenset(
            {
                "CC",
                "CXX",
                "CPP",
                "LD",
                "AS",
                "AR",
                "NM",
                "RANLIB",
                "STRIP",
                "OBJCOPY",
                "CFLAGS",
                "CXXFLAGS",
                "CPPFLAGS",
                "LDFLAGS",
                "LDSHARED",
                "CPATH",
                "C_INCLUDE_PATH",
                "CPLUS_INCLUDE_PATH",
                "LIBRARY_PATH",
                "COMPILER_PATH",
                "GCC_EXEC_PREFIX",
                "DEPENDENCIES_OUTPUT",
                "SUNPRO_DEPENDENCIES",
                "CUDAHOSTCXX",
                "MAKEFLAGS",
                "MFLAGS",
            }
        ),
        ("NVCC_", "CCACHE_"),
    ),
    # Interpreters' start-up hooks and module paths: PYTHONPATH / PYTHONSTARTUP / PYTHONBREAKPOINT /
    # PYTHONWARNINGS import code, PERL5OPT / RUBYOPT / NODE_OPTIONS / JAVA_TOOL_OPTIONS add options
    # that load code, and the *LIB / *PATH ones say where modules come from.
    "interpreters": (
        frozenset(
            {
                "RUBYOPT",
                "RUBYLIB",
                "NODE_OPTIONS",
                "NODE_PATH",
                "JAVA_TOOL_OPTIONS",
                "JDK_JAVA_OPTIONS",
                "CLASSPATH",
                "TCLLIBPATH",
            }
        ),
        ("PYTHON", "PERL", "GEM_", "LUA_"),
    ),
    # Version control and remote shells: git runs GIT_SSH_COMMAND, GIT_ASKPASS, GIT_EXTERNAL_DIFF and
    # reads GIT_CONFIG_* (whose settings run programs too); ssh runs SSH_ASKPASS.
    "git and ssh": (frozenset(), ("GIT_", "SSH_")),
    # Trust in TLS peers and OpenSSL's configuration: OPENSSL_CONF / OPENSSL_ENGINES /
    # OPENSSL_MODULES load engines and providers (shared objects); the CA bundles decide whom a
    # download or a data stream trusts.
    "TLS": (
        frozenset(
            {
                "OPENSSL_CONF",
                "OPENSSL_ENGINES",
                "OPENSSL_MODULES",
                "CURL_CA_BUNDLE",
                "REQUESTS_CA_BUNDLE",
                "NODE_EXTRA_CA_CERTS",
            }
        ),
        ("SSL_CERT_",),
    ),
    # Where the attempt lives: the worker gives each attempt its own HOME and TMPDIR and its PATH (the
    # worker's interpreter first); TMP and TEMP are Python's fallbacks for TMPDIR; XDG_* moves every
    # tool's configuration, cache and runtime sockets.
    "paths and identity": (
        frozenset({"HOME", "TMPDIR", "TMP", "TEMP", "PATH", "PWD", "OLDPWD", "USER", "LOGNAME"}),
        ("XDG_",),
    ),
    # torch, inductor and triton: cache and extension directories hold compiled code that is loaded
    # later (TORCHINDUCTOR_CACHE_DIR, TORCH_EXTENSIONS_DIR, TRITON_CACHE_DIR), TRITON_PTXAS_PATH and
    # TRITON_LIBCUDA_PATH name a program and a library to run, TORCH_HOME holds hub code, and the
    # TORCH_NCCL_* error handling is the operator's (passed through from the worker). The harmless
    # diagnostics are allowed below.
    "torch": (frozenset(), ("TORCH", "PYTORCH_", "TRITON_")),
    # Accelerators and collectives: CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES are the devices the
    # worker assigned this job (another value takes another job's GPU), CUDA_HOME / CUDA_PATH say
    # where nvcc is; NCCL_NET_PLUGIN / NCCL_TUNER_PLUGIN load shared objects, NCCL_DEBUG_FILE writes
    # where it says, and the interfaces and transports are the operator's (passed through); GLOO_*,
    # UCX_* and libfabric's FI_* (FI_PROVIDER_PATH loads plugins) likewise.
    "accelerators and collectives": (frozenset(), ("CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "UCX_", "FI_")),
}

# Knobs of the families above that only make a rank say more or change its own memory use, on
# stderr (the job's log) or in its own process: a user debugging a job needs them, and none names a
# file, a program or a device.
ALLOWED_ENV_NAMES = frozenset(
    {
        "NCCL_DEBUG",
        "NCCL_DEBUG_SUBSYS",
        "TORCH_LOGS",
        "TORCH_SHOW_CPP_STACKTRACES",
        "TORCH_CPP_LOG_LEVEL",
        "TORCH_DISTRIBUTED_DEBUG",
        "TORCHDYNAMO_VERBOSE",
        "CUDA_LAUNCH_BLOCKING",
        "CUDA_MODULE_LOADING",
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_NO_CUDA_MEMORY_CACHING",
    }
)


def env_name_problem(name: str) -> str | None:
    """Why a job may not set the variable `name`, or None if it may."""
    # fullmatch, not `$`: Python's `$` also matches before a trailing newline.
    if re.fullmatch(ENV_NAME_PATTERN[1:-1], name) is None:
        return (
            "expected a variable name of upper-case letters, digits and '_', starting with a letter, "
            "at most 128 characters"
        )
    if name in ALLOWED_ENV_NAMES:
        return None
    for group, (names, prefixes) in DENIED_ENV_GROUPS.items():
        if name in names:
            return f"{name} is refused: it steers {STEERS[group]} (docs/security.md, Job variables)"
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is not None:
            return (
                f"{name} is refused: {prefix}* variables steer {STEERS[group]} "
                "(docs/security.md, Job variables)"
            )
    return None


def env_name_allowed(name: str) -> bool:
    """Whether a job may set the variable `name` (the worker's check of a stored spec)."""
    return env_name_problem(name) is None


# What each group's variables steer, in the words a 422 uses.
STEERS = {
    "dptrain and torchrun": "dptrain's and torchrun's wiring of the ranks, which the worker sets",
    "loader and C library": "the dynamic loader or the C library",
    "shells": "shells and the programs other tools start",
    "compilers": "the compilers and build tools torch runs",
    "interpreters": "an interpreter's start-up or module path",
    "git and ssh": "git or ssh",
    "TLS": "OpenSSL or whom TLS trusts",
    "paths and identity": "the attempt's own directories or identity, which the worker sets",
    "torch": "torch's, inductor's or triton's compilers and caches",
    "accelerators and collectives": "the devices and network the worker assigned",
}
