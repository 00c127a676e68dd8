"""Proxies on loopback in front of a storage server (moto and fake-gcs keep data in
memory): a TCP proxy that can be cut and restored, to simulate an outage without
losing the server's state; an HTTP proxy that corrupts one object's bytes on the way."""

from __future__ import annotations

import http.client
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class CuttableProxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.sent = 0  # bytes from the server to the clients
        self._cut_at: tuple[int, float] | None = None  # (after these many bytes, for these seconds)
        self.cuts = 0

    def cut_after(self, sent: int, seconds: float) -> None:
        """Cut once `sent` bytes have gone to the clients, and restore after `seconds`."""
        self._cut_at = (sent, seconds)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Refuse new connections and reset the open ones, as a dead endpoint would."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()
            self._conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.update((client, upstream))
            for src, dst, down in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, down), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool = False) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if down:
                    self._count(len(data))
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.close()
                except OSError:
                    pass
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)


    def _count(self, n: int) -> None:
        with self._lock:
            self.sent += n
            due = self._cut_at is not None and self.sent >= self._cut_at[0]
            seconds = self._cut_at[1] if due else 0.0
            if due:
                self._cut_at = None
        if due:
            self.cuts += 1
            self.cut()
            timer = threading.Timer(seconds, self.start)
            timer.daemon = True
            timer.start()


class CorruptingProxy:
    """Forwards every request to `upstream` (http://host:port) and flips the first byte
    of each GET body of the object whose key ends with `corrupt`: bytes damaged on the
    way, while the store's listing and checksums stay right. With `status`, answers the
    first `times` GETs and HEADs of that object with it instead (S3's error body, `code`)."""

    def __init__(self, upstream: str, corrupt: str, status: int | None = None, code: str = "", times: int = 10**9):
        parts = urlsplit(upstream)
        target, key = (parts.hostname, parts.port), corrupt
        self.answered = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                ours = self.command in ("GET", "HEAD") and self.path.split("?")[0].endswith(key)
                if status and ours and proxy.answered < times:
                    proxy.answered += 1
                    error = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                             f"<Message>{code}</Message></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(error)
                    return
                connection = http.client.HTTPConnection(*target, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                connection.request(self.command, self.path, body=body or None, headers=headers)
                response = connection.getresponse()
                data = response.read()
                if not status and self.command == "GET" and self.path.split("?")[0].endswith(key) and data:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                # A HEAD has no body: its Content-Length is the object's (or the part's).
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def __enter__(self) -> CorruptingProxy:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
