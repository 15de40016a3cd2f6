"""The server's commands in the `dptrain` program, loaded from `dptrain_server` only when asked for.

Click's lazy-loading pattern (a group whose `list_commands` names commands that `get_command` imports
on demand), on typer's own group class, which `typer.Typer(cls=...)` accepts. The client commands
(submit, list, logs, ...) never import `dptrain_server`; `dptrain --help`, which shows every command's
help line, and the server commands themselves do. `dptrain_server` imports nothing heavy itself (its
commands import the server's modules when they run), so listing them costs a few milliseconds.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:
    # Recent typer vendors click (its groups take these contexts, not click's own); the
    # client's oldest typer uses click itself. Only the annotations name it, so both run this.
    from typer import _click

from dptrain_cli.extras import missing_extra

# Each server command, and the extra it needs (docs in dptrain_cli/extras.py).
SERVER_COMMANDS = {
    "api": "server",
    "worker": "worker",
    "webhook-worker": "server",
    "migrate": "server",
    "up": "all",
    "users": "server",
}
SERVER_PACKAGE = "dptrain_server"


class WithServerCommands(TyperGroup):
    """The `dptrain` group: its own commands, then the server's, imported on first use."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self._server: TyperGroup | None = None

    def list_commands(self, ctx: _click.Context) -> list[str]:
        """The client's commands, then the server's."""
        return [*super().list_commands(ctx), *SERVER_COMMANDS]

    def get_command(self, ctx: _click.Context, cmd_name: str) -> _click.Command | None:
        """A client command as registered; a server command from `dptrain_server`, loaded now."""
        if cmd_name not in SERVER_COMMANDS:
            return super().get_command(ctx, cmd_name)
        if importlib.util.find_spec(SERVER_PACKAGE) is None:
            return _not_installed(cmd_name)
        if self._server is None:
            from dptrain_server.commands import app

            self._server = typer.main.get_group(app)
        return self._server.commands[cmd_name]


def _not_installed(name: str) -> TyperCommand:
    """A stand-in for a server command whose package is missing: it names the extra, whatever its args."""
    extra = SERVER_COMMANDS[name]

    def refuse() -> None:
        raise missing_extra(extra, f"the server's commands ({SERVER_PACKAGE}) are not installed")

    return TyperCommand(
        name,
        callback=refuse,
        help=f"Not installed: needs the {extra!r} extra of dptrain.",
        # `dptrain up --port 9000` or `dptrain up --help` still gets the pip line, not a usage error.
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )
