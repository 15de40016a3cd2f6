"""A small closed-loop HTTP/1.1 load generator (keep-alive, N connections), run as its own process.

    python -m bench.loadgen --url http://127.0.0.1:PORT/v1/jobs --method POST --body-file spec.json \
        --header 'Authorization: Bearer ...' --concurrency 50 --duration 10

Each of `concurrency` connections sends a request, reads the whole answer, and sends the next
(like wrk). Prints one JSON object: requests, seconds, requests per second, latency p50/p90/p99 in
ms, and the count per status code. Raw asyncio sockets rather than an HTTP client library, so that
on a 2-core machine the generator takes as little CPU from the server as it can. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from bench.common import percentile


def build_request(method: str, url: str, headers: Sequence[str], body: bytes) -> tuple[str, int, bytes]:
    """(host, port, request bytes) for a keep-alive request."""
    u = urlsplit(url)
    if u.scheme != "http" or u.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("loadgen: loopback http:// URLs only")
    path = u.path + (f"?{u.query}" if u.query else "")
    lines = [f"{method} {path} HTTP/1.1", f"Host: {u.hostname}:{u.port}", "Connection: keep-alive", *headers]
    if body or method in ("POST", "PUT", "PATCH"):
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return u.hostname, u.port or 80, ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        key = name.strip().lower()
        if key == b"content-length":
            length = int(value)
        elif key == b"transfer-encoding":
            raise RuntimeError("loadgen does not read chunked answers")
    if length:
        await reader.readexactly(length)
    return status


async def _client(
    host: str, port: int, request: bytes, stop_at: float, max_requests: int, shared: dict[str, int]
) -> tuple[list[float], Counter[int]]:
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < stop_at and shared["sent"] < max_requests:
            shared["sent"] += 1
            start = time.perf_counter()
            writer.write(request)
            status = await _read_response(reader)
            latencies.append(time.perf_counter() - start)
            statuses[status] += 1
    finally:
        writer.close()
    return latencies, statuses


async def load(
    host: str, port: int, request: bytes, *, concurrency: int, duration: float, max_requests: int
) -> dict[str, object]:
    """Run the closed loop; figures over all connections."""
    shared = {"sent": 0}
    start = time.perf_counter()
    stop_at = start + duration
    parts = await asyncio.gather(
        *(_client(host, port, request, stop_at, max_requests, shared) for _ in range(concurrency))
    )
    seconds = time.perf_counter() - start
    latencies = [x for lat, _ in parts for x in lat]
    statuses: Counter[int] = Counter()
    for _, s in parts:
        statuses.update(s)
    ms = [x * 1000 for x in latencies]
    return {
        "requests": len(latencies),
        "seconds": seconds,
        "per_s": len(latencies) / seconds,
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms) if ms else float("nan"),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "concurrency": concurrency,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point: prints the figures as JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--method", default="GET")
    p.add_argument("--header", action="append", default=[])
    p.add_argument("--body-file", type=Path)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--duration", type=float, default=10.0, help="seconds (a bound)")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="a bound on requests sent")
    args = p.parse_args(argv)
    body = args.body_file.read_bytes() if args.body_file else b""
    host, port, request = build_request(args.method, args.url, args.header, body)
    try:
        import uvloop  # uvicorn's own event loop: less generator CPU per request

        uvloop.install()
    except ImportError:  # pragma: no cover - asyncio's loop works, only slower
        pass
    out = asyncio.run(
        load(
            host,
            port,
            request,
            concurrency=args.concurrency,
            duration=args.duration,
            max_requests=args.max_requests,
        )
    )
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
