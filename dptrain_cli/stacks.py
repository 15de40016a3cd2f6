"""`dptrain stacks ID`: where every thread of every rank of a running job is, as text."""

from __future__ import annotations

from api_schemas import JobStacks
from dptrain_cli.output import say


def show_stacks(stacks: JobStacks) -> None:
    """Each rank's process, the frame it is in, then each thread's frames, innermost first (all inert)."""
    if not stacks.fresh:
        say("no fresh dump came in time: these are the latest ones", stderr=True)
    if not stacks.dumps:
        say("no stacks have been read for this job yet", stderr=True)
    for dump in stacks.dumps:
        say(f"node {dump.node}, attempt {dump.attempt}, {dump.reason} at {dump.taken_at.isoformat()}")
        if dump.note:
            say(f"  note: {dump.note}")
        for p in dump.processes:
            who = f"rank {p.rank}" if p.rank is not None else "rank ?"
            say(f"{who} pid {p.pid}: {p.where or p.error or 'no frame'}")
            for t in p.threads:
                say(f"  thread {t.thread_id} {t.name or ''} ({'active' if t.active else 'idle'})")
                for f in t.frames:
                    say(f"    {f.name} ({f.file}:{f.line})")
