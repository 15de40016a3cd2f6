"""Which names a job's `env` may set: the pattern, the deny-list and its exceptions (api_schemas/env.py)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from api_schemas import JobSpec
from api_schemas.env import ALLOWED_ENV_NAMES, DENIED_ENV_GROUPS, env_name_problem
from tests.conftest import job_spec

# Finding 1 of issue 30, and the other names the issue lists.
FINDING = ["CXX", "BASH_ENV", "CC", "ENV", "GCONV_PATH", "OPENSSL_CONF", "GLIBC_TUNABLES"]
LISTED = [
    *("CPP", "LD", "AS", "AR", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "SHELL", "SHELLOPTS"),
    *("BASHOPTS", "PS4", "PROMPT_COMMAND", "IFS", "CDPATH", "OPENSSL_ENGINES", "MALLOC_CHECK_"),
    *("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONSTARTUP", "PERL5OPT", "PERL5LIB", "PERLLIB"),
    *("RUBYOPT", "RUBYLIB", "NODE_OPTIONS", "JAVA_TOOL_OPTIONS", "GIT_SSH_COMMAND", "SSL_CERT_FILE"),
    *("CURL_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "HOSTALIASES", "LOCALDOMAIN", "RES_OPTIONS", "NLSPATH"),
    *("LOCPATH", "TZDIR", "TERMINFO", "XDG_CONFIG_HOME", "HOME", "TMPDIR", "PATH"),
    *("TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "TORCH_HOME", "TRITON_PTXAS_PATH"),
    *("CUDA_VISIBLE_DEVICES", "CUDA_HOME", "NCCL_NET_PLUGIN", "NCCL_DEBUG_FILE", "NCCL_SOCKET_IFNAME"),
    *("DPTRAIN_DATA_ROOT", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
    # Where a rank's exception is recorded (workers/command/failure.py): a job must not point them elsewhere.
    *("DPTRAIN_EXCEPTION_FILE", "TORCHELASTIC_ERROR_FILE"),
]
# Refused by the pattern itself: lower case (a twin some programs read), a leading `_`
# (`_JAVA_OPTIONS`), bash's exported functions, a digit first, too long.
MALFORMED = ["cxx", "http_proxy", "_JAVA_OPTIONS", "_", "BASH_FUNC_x%%", "1X", "A-B", "A" * 129, ""]
ALLOWED = [
    "MY_FLAG",
    "WANDB_MODE",
    "HF_HUB_OFFLINE",
    "OMP_NUM_THREADS",
    "LDX",
    "A" * 128,
    *sorted(ALLOWED_ENV_NAMES),
]


def _refusal(name: str) -> dict[str, object]:
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate(job_spec(env={name: "x"}))
    (error,) = refused.value.errors()
    return dict(error)


@pytest.mark.parametrize("name", FINDING + LISTED)
def test_a_name_that_steers_the_worker_is_refused_naming_it(name: str) -> None:
    error = _refusal(name)
    assert error["loc"][:2] == ("env", name), error
    assert f"{name} is refused" in str(error["msg"]), error


@pytest.mark.parametrize("name", MALFORMED)
def test_a_name_outside_the_pattern_is_refused_at_its_key(name: str) -> None:
    error = _refusal(name)
    assert error["loc"][:2] == ("env", name), error


@pytest.mark.parametrize("name", ALLOWED)
def test_a_name_of_the_users_own_is_kept(name: str) -> None:
    assert JobSpec.model_validate(job_spec(env={name: "1"})).env == {name: "1"}


def test_every_exception_lies_in_a_denied_family() -> None:
    # An exception outside every family would be dead weight, and hide a typo in its name.
    prefixes = tuple(p for _, ps in DENIED_ENV_GROUPS.values() for p in ps)
    assert all(n.startswith(prefixes) for n in ALLOWED_ENV_NAMES), ALLOWED_ENV_NAMES


@given(st.text(alphabet=st.characters(codec="ascii"), max_size=140))
def test_the_pattern_decides_the_form_of_any_name(name: str) -> None:
    problem = env_name_problem(name)
    if re.fullmatch(r"[A-Z][A-Z0-9_]{0,127}", name) is None:
        assert problem is not None and problem.startswith("expected a variable name"), (name, problem)
    else:
        assert problem is None or f"{name} is refused" in problem, (name, problem)


@given(
    st.sampled_from([p for _, ps in DENIED_ENV_GROUPS.values() for p in ps]),
    st.from_regex(r"[A-Z0-9_]{0,20}", fullmatch=True),
)
def test_every_name_of_a_denied_family_is_refused_unless_excepted(prefix: str, rest: str) -> None:
    name = prefix + rest
    problem = env_name_problem(name)
    if name in ALLOWED_ENV_NAMES:
        assert problem is None, (name, problem)
    else:
        assert problem is not None and f"{name} is refused" in problem, (name, problem)
