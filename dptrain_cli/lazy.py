"""The server's commands in the `dptrain` program, found by entry point and loaded only when asked for.

The client knows no server module: whoever provides server commands registers each one in the entry
point group `dptrain.server_commands` (dptrain does so in pyproject.toml for `dptrain_server`), named
after the command, pointing at a function (typer makes it a command, its docstring the help line) or
at a `typer.Typer` (a group of commands, as `users`). The arrows then all point down: the server's
package imports the client's (dptrain_cli.extras), never the other way.

Click's lazy-loading pattern (a group whose `list_commands` names commands that `get_command` imports
on demand), on typer's own group class, which `typer.Typer(cls=...)` accepts. The client commands
(submit, list, logs, ...) never read the entry points nor load a server module; `dptrain --help`,
which shows every command's help line, and the server commands themselves do. The server's command
modules import nothing heavy themselves (their commands import the server's modules when they run),
so listing them costs a few milliseconds.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:
    # Recent typer vendors click (its groups take these contexts, not click's own); the
    # client's oldest typer uses click itself. Only the annotations name it, so both run this.
    from typer import _click

from dptrain_cli.extras import missing_extra

GROUP = "dptrain.server_commands"
# What brings the server's commands (dptrain_cli/extras.py): named when their module cannot be
# loaded at all. A command whose module loads names its own extra when a package it needs is missing.
SERVER_EXTRA = "server"


def server_commands() -> dict[str, EntryPoint]:
    """The server's commands on this install, by name (the first registration of a name wins)."""
    found: dict[str, EntryPoint] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name):
        found.setdefault(ep.name, ep)
    return found


class WithServerCommands(TyperGroup):
    """The `dptrain` group: its own commands, then the server's, imported on first use."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self._server: dict[str, EntryPoint] | None = None
        self._loaded: dict[str, _click.Command] = {}

    def _server_commands(self) -> dict[str, EntryPoint]:
        if self._server is None:
            own = set(self.commands)  # a client command keeps its name whatever a plugin registers
            self._server = {name: ep for name, ep in server_commands().items() if name not in own}
        return self._server

    def list_commands(self, ctx: _click.Context) -> list[str]:
        """The client's commands, then the server's."""
        return [*super().list_commands(ctx), *self._server_commands()]

    def get_command(self, ctx: _click.Context, cmd_name: str) -> _click.Command | None:
        """A client command as registered; a server command from its entry point, loaded now."""
        own = super().get_command(ctx, cmd_name)
        if own is not None:
            return own
        ep = self._server_commands().get(cmd_name)
        if ep is None:
            return None
        if cmd_name not in self._loaded:
            self._loaded[cmd_name] = _load(ep)
        return self._loaded[cmd_name]


def _load(ep: EntryPoint) -> _click.Command:
    """The command an entry point names: a typer app's command or group, or one made of a function."""
    try:
        target = ep.load()
    except ImportError as exc:
        # Our own module missing (a third-party one is the command's to name when it runs).
        if (exc.name or "").split(".")[0] != ep.module.split(".")[0]:
            raise
        return _not_installed(ep, exc)
    if isinstance(target, typer.Typer):
        command = typer.main.get_command(target)
    elif callable(target):
        made = typer.Typer()
        made.command(ep.name)(target)
        command = typer.main.get_command(made)
    else:
        raise TypeError(f"{GROUP} entry point {ep.name} = {ep.value}: neither a function nor a typer.Typer")
    command.name = ep.name  # a Typer's group has none of its own; help lists commands by it
    return command


def _not_installed(ep: EntryPoint, exc: ImportError) -> TyperCommand:
    """A stand-in for a server command whose module is missing: it names the extra, whatever its args."""

    def refuse() -> None:
        raise missing_extra(SERVER_EXTRA, f"the server's commands ({ep.module}) are not installed: {exc}")

    return TyperCommand(
        ep.name,
        callback=refuse,
        help=f"Not installed: needs the {SERVER_EXTRA!r} extra of dptrain.",
        # `dptrain up --port 9000` or `dptrain up --help` still gets the pip line, not a usage error.
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )
