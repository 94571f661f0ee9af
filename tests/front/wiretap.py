"""A TCP relay on loopback that keeps every byte the gateway sent towards a backend.

The gateway's backend URL points at the tap; the tap forwards each connection to the real
(simulated) engine and records the client-to-engine bytes, so a test can assert what
reached the backend (headers included) without the engine recording anything itself.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class Wiretap:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._sent = bytearray()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        self._spawn(self._accept)

    def _spawn(self, fn: object, *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._socks += [client, upstream]
            self._spawn(self._pump, client, upstream, True)
            self._spawn(self._pump, upstream, client, False)

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            if record:
                with self._lock:
                    self._sent += data
            try:
                dst.sendall(data)
            except OSError:
                return

    def sent(self) -> bytes:
        """Every byte sent towards the backend so far."""
        with self._lock:
            return bytes(self._sent)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        self._server.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self._threads:
            t.join(timeout=2)
