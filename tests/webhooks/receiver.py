"""A webhook receiver on 127.0.0.1: a threaded http.server that records what it was sent."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """Records each POST; holds every answer while `hold` is clear (a slow receiver)."""

    port: int
    received: list[Received] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)
    hold: threading.Event = field(default_factory=threading.Event)
    server: ThreadingHTTPServer | None = None

    def start(self) -> Receiver:
        """Listen on 127.0.0.1:`port` in a daemon thread."""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with outer.arrived:
                    outer.received.append(Received(dict(self.headers.items()), body))
                    outer.arrived.notify_all()
                outer.hold.wait(60)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.hold.set()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening (the port refuses connections again)."""
        self.hold.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def wait_for(self, count: int, timeout: float = 60.0) -> list[Received]:
        """The first `count` requests, once that many arrived."""
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.received) >= count, timeout), self.received
            return list(self.received[:count])
