"""The client's own settings: where the API is and which token to send, nothing of the server's.

Read from three variables only, so a server's environment (`DPTRAIN_DATABASE_URL`, a short
`DPTRAIN_BOOTSTRAP_TOKEN`...) never reaches or breaks a client on the same machine. Plain
`os.environ` rather than pydantic-settings: three strings do not justify a dependency of the light
client (`pip install dptrain`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

API_URL_ENV = "DPTRAIN_API_URL"
TOKEN_ENV = "DPTRAIN_TOKEN"
HOME_ENV = "DPTRAIN_HOME"
DEFAULT_API_URL = "http://127.0.0.1:8000"
DEFAULT_HOME = ".dptrain"
# Where `dptrain up` leaves its admin token, under DPTRAIN_HOME.
TOKEN_FILE = "token"


@dataclass(frozen=True)
class ClientSettings:
    """The API's URL and the bearer token (None: send none, and get 401s)."""

    api_url: str = DEFAULT_API_URL
    token: str | None = None

    def __repr__(self) -> str:
        # Never print a token into a log or a traceback.
        return f"ClientSettings(api_url={self.api_url!r}, token={'***' if self.token else None})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientSettings:
        """DPTRAIN_API_URL, and DPTRAIN_TOKEN or else the token file `dptrain up` wrote in DPTRAIN_HOME."""
        env = os.environ if environ is None else environ
        token = env.get(TOKEN_ENV, "").strip() or None
        if token is None:
            path = Path(env.get(HOME_ENV) or DEFAULT_HOME) / TOKEN_FILE
            try:
                token = path.read_text().strip() or None
            except (FileNotFoundError, NotADirectoryError):
                token = None
        return cls(api_url=env.get(API_URL_ENV, "").strip() or DEFAULT_API_URL, token=token)
