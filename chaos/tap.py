"""A passive wire tap in the router: every inference request the gateway sends, by backend.

The engines' own arrival logs cannot answer "did the gateway send anything to the faulty
node after detecting it?" for every fault: a frozen engine timestamps the requests queued in
its socket when it is resumed, and a blackholed link never delivers them. So the lab listens
on the router's uplink, where the gateway's packets enter before any fault rule sees them,
with an AF_PACKET socket opened from a thread that has joined the router namespace
(`setns`), and records each TCP segment that starts an HTTP `POST` to an engine port:
wire time, backend address, and whether it is a probe (`x-pulsegate-probe` in its headers).
Retransmitted segments (same connection and sequence number) count once. Read-only: the tap
never delays, drops or alters a packet.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

from chaos import netlab

_CLONE_NEWNET = 0x40000000
_ETH_P_IP = 0x0800
_PROBE = b"x-pulsegate-probe"


@dataclass(frozen=True, slots=True)
class Send:
    t: float  # wall time at the router
    ip: str  # engine address
    probe: bool


class Tap:
    def __init__(self, ns: str = netlab.RTR, iface: str = "uplink", port: int = 8000) -> None:
        self.ns = ns
        self.iface = iface
        self.port = port
        self.sends: list[Send] = []
        self._seen: set[tuple[int, int, int]] = set()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-tap", daemon=True)

    def start(self) -> Tap:
        self._thread.start()
        if not self._ready.wait(5):
            raise RuntimeError("wire tap did not start")
        if self._error is not None:
            raise RuntimeError(f"wire tap: {self._error}") from self._error
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def client_sends(self, ip: str, start: float, end: float) -> list[float]:
        """Wire times of client (non-probe) requests to `ip` in [start, end)."""
        return [s.t for s in list(self.sends) if s.ip == ip and not s.probe and start <= s.t < end]

    def _run(self) -> None:
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            with open(f"/run/netns/{self.ns}") as f:
                if libc.setns(f.fileno(), _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_IP))
            sock.bind((self.iface, 0))
            sock.settimeout(0.2)
        except BaseException as e:  # reported by start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        with contextlib.closing(sock):
            while not self._stop.is_set():
                try:
                    frame = sock.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                self._parse(frame, time.time())

    def _parse(self, frame: bytes, now: float) -> None:
        ip = frame[14:]
        if len(ip) < 20 or ip[9] != 6:  # TCP only
            return
        ihl = (ip[0] & 0x0F) * 4
        tcp = ip[ihl:]
        if len(tcp) < 20:
            return
        sport, dport, seq = struct.unpack("!HHI", tcp[:8])
        if dport != self.port:
            return
        payload = tcp[(tcp[12] >> 4) * 4 :]
        if not payload.startswith(b"POST "):
            return
        key = (int.from_bytes(ip[16:20], "big"), sport, seq)
        if key in self._seen:
            return  # a retransmission
        self._seen.add(key)
        head = payload.split(b"\r\n\r\n", 1)[0].lower()
        self.sends.append(Send(now, socket.inet_ntoa(ip[16:20]), _PROBE in head))
