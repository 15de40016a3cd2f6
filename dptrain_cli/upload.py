"""`submit --workdir`: pack and upload the tree, and say on stderr what went and what was left out.

Nothing is left out silently: the ignore rules (.gitignore, .dptrainignore) are written for git, and
a repository's rules keep out exactly the data and weights a job may need (nanoGPT's `*.bin`,
`*.pkl`). Those are listed with their total and the `--include` that takes them; the other ignored
files are counted in one line, and what is never code (.git, environments, caches) named in one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import typer
from rich.filesize import decimal

from dptrain.client import Client, CodeTooLarge
from dptrain.errors import PayloadTooLarge
from dptrain.left_out import LeftOut, Tally, suggested_includes
from dptrain_cli.output import say

EXIT_REFUSED = 3  # dptrain_cli.main's code for "refused", as `submit --help` documents it
# Ignored files other than data and weights are named up to this many; the count covers them all.
OTHERS_NAMED = 5


def _total(tally: Tally) -> str:
    return f"{tally.count} file{'s' if tally.count != 1 else ''}, {decimal(tally.bytes)}"


def report_left_out(left_out: LeftOut) -> None:
    """Say on stderr what the archive left out and what `--include` took."""
    data, other = left_out.data, left_out.other
    if data.count:
        say(f"left out by the ignore rules, looks like data or weights: {_total(data)}", stderr=True)
        for path, size in data.biggest:
            say(f"  {decimal(size):>10}  {path}", stderr=True)
        if data.count > len(data.biggest):
            say(f"  ... and {data.count - len(data.biggest)} more", stderr=True)
        takes = " ".join(f"--include '{p}'" for p in suggested_includes(p for p, _ in data.biggest))
        say(
            f"  {takes} uploads them; a large data set belongs under the workers' DPTRAIN_DATA_ROOT "
            '(docs/code.md, "Getting data to a job")',
            stderr=True,
        )
    if other.count:
        names = [p for p, _ in other.biggest[:OTHERS_NAMED]]
        more = ", ..." if other.count > len(names) else ""
        say(f"left out by the ignore rules, other: {_total(other)} ({', '.join(names)}{more})", stderr=True)
    if left_out.never:
        never = ", ".join(f"{k} ({n})" if n > 1 else k for k, n in sorted(left_out.never.items()))
        say(f"never packed (version control, environments, caches): {never}", stderr=True)
    if left_out.included.count:
        say(f"taken by --include: {_total(left_out.included)}", stderr=True)
    for pattern in left_out.unmatched:
        say(f"warning: --include '{pattern}' took nothing: no ignored file matches it", stderr=True)


def too_big(workdir: Path, exc: CodeTooLarge) -> typer.Exit:
    """Say why the archive is refused and what made it big; exit 3."""
    size = exc.packed.size_bytes
    reason = str(exc) if exc.by_server else f"the archive is {size} bytes, over --max-code-bytes {exc.limit}"
    say(f"code refused: {reason}", stderr=True)
    say("largest paths it would upload:", stderr=True)
    for path, size in exc.packed.largest:
        say(f"  {decimal(size):>10}  {path}", stderr=True)
    if (taken := exc.packed.left_out.included).count:
        say(f"of them taken by --include: {_total(taken)}", stderr=True)
    say(
        f"Leave out what the job does not need with a .dptrainignore in {workdir} (.gitignore syntax).",
        stderr=True,
    )
    return typer.Exit(EXIT_REFUSED)


def ship_code(client: Client, workdir: Path, *, max_bytes: int | None, include: Sequence[str] = ()) -> str:
    """Pack and upload `workdir` unless the server has it; its sha256. Says what it did on stderr."""
    try:
        code = client.upload_code(workdir, max_bytes=max_bytes, include=include)
    except CodeTooLarge as exc:
        raise too_big(workdir, exc) from exc
    except PayloadTooLarge as exc:
        say(f"code refused: {exc.detail}", stderr=True)
        raise typer.Exit(EXIT_REFUSED) from exc
    # stderr: stdout holds only the job id, for `JOB=$(dptrain submit ...)`.
    say(f"code {code.sha256[:12]} {decimal(code.size_bytes)} ({code.files} files)", stderr=True)
    report_left_out(code.left_out)
    for path, why in code.skipped:
        say(f"warning: skipped {path}: {why}", stderr=True)
    say("code uploaded" if code.uploaded else "code already on the server", stderr=True)
    return code.sha256
