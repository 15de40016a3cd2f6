"""`dptrain webhooks`: an admin's commands for the endpoints that receive job state changes."""

from __future__ import annotations

import typer
from rich.table import Table

from dptrain_cli.calls import OUTPUT, api, fetch
from dptrain_cli.output import Output, emit_json, inert, out, say

app = typer.Typer(no_args_is_help=True, help="Webhooks: signed POSTs of every job state change (admins).")


@app.command("add")
def add(
    url: str,
    event: list[str] = typer.Option([], "--event", help="A job state to send (repeat); default: all."),
    owner: str | None = typer.Option(None, help="Only this user's jobs (default: every job)."),
    output: Output = OUTPUT,
) -> None:
    """Register a webhook; prints its signing secret, which is not shown again."""
    with api() as client:
        hook = client.create_webhook(url, events=event or "all", owner=owner)
    if output is Output.json:
        emit_json(hook)
        return
    say(f"webhook {hook.id} -> {hook.url}")
    say(f"secret {hook.secret}  (shown this once: keep it where the receiver can read it)")


@app.command("list")
def list_webhooks(output: Output = OUTPUT) -> None:
    """List the registered webhooks."""
    if (hooks := fetch(output, lambda c: c.webhooks())) is None:
        return
    table = Table("id", "url", "events", "owner", "created")
    for h in hooks:
        events = h.events if isinstance(h.events, str) else ",".join(h.events)
        row = (h.id, h.url, events, h.owner or "(all)", h.created_at.isoformat())
        table.add_row(*map(inert, row))
    out.print(table)


@app.command("rm")
def remove(webhook_id: str) -> None:
    """Remove a webhook (its deliveries not yet sent are dropped)."""
    with api() as client:
        client.delete_webhook(webhook_id)
    say(f"webhook {webhook_id} removed")


@app.command("deliveries")
def deliveries(
    webhook_id: str, limit: int = typer.Option(20, min=1, max=1000), output: Output = OUTPUT
) -> None:
    """A webhook's newest deliveries with their last status."""
    if (items := fetch(output, lambda c: c.webhook_deliveries(webhook_id, limit=limit))) is None:
        return
    table = Table("id", "job", "event", "status", "attempts", "last", "created")
    for d in items:
        last = str(d.last_status_code or "") if d.last_error is None else d.last_error[:60]
        row = (d.id, d.job_id, d.event.value, d.status, str(d.attempts), last, d.created_at.isoformat())
        table.add_row(*map(inert, row))
    out.print(table)
