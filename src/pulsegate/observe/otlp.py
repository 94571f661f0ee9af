"""OTLP/HTTP traces on the wire: the protobuf of `ExportTraceServiceRequest`, and its POST.

Why by hand and not through the OpenTelemetry SDK: measured on this box
(`bench/observe_cost.py`), the SDK's exporter path (a `ReadableSpan` per span, then its
`encode_spans`) cost ~290 us of CPU per traced request (two spans), 70% on top of the
~400 us the whole proxy path costs, and the generated `opentelemetry-proto` classes ~90 us
a span. The tracer sends one message shape with a fixed set of fields, so it is written
here directly: a span is a few byte strings joined, and an attribute whose key and value
were seen before (the model, the backend, status 200, ...) is one dict lookup of its
encoded bytes. The tests decode every message with `opentelemetry-proto`, the reference.

Wire format (https://protobuf.dev/programming-guides/encoding/): a field is a tag
`(number << 3) | wire type` as a varint, then a varint (type 0), 8 bytes little-endian
(type 1, fixed64 / double), a varint length and the bytes (type 2: strings, bytes, nested
messages) or 4 bytes (type 5, fixed32). Field numbers from `opentelemetry/proto/trace/v1/
trace.proto`, `common/v1/common.proto`, `resource/v1/resource.proto`.

`Collector` POSTs a message to the collector over one keep-alive `http.client`
connection, from the tracer's exporter thread only (blocking, with a timeout).
"""

from __future__ import annotations

import http.client
import ssl
import struct
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

# Span.kind / Status.code values (SpanKind, Status.StatusCode).
SERVER, CLIENT = 2, 3
UNSET, ERROR = 0, 2
# Span.flags: the W3C trace flags in the low byte, and whether the parent is remote.
HAS_IS_REMOTE, IS_REMOTE = 0x100, 0x200
# Distinct encoded attributes remembered; past this the cache starts over (a client
# choosing model names must not grow memory without bound).
MAX_CACHED = 4096

Value = str | bool | int | float
_FIXED64 = struct.Struct("<Q")
_DOUBLE = struct.Struct("<d")
_FIXED32 = struct.Struct("<I")


_ONE_BYTE = [bytes((n,)) for n in range(0x80)]


def varint(n: int) -> bytes:
    """`n` as a protobuf varint (a negative int64 as its 64-bit two's complement)."""
    if 0 <= n < 0x80:
        return _ONE_BYTE[n]
    if 0 < n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    if n < 0:
        n &= (1 << 64) - 1
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): a string, bytes or a nested message."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def any_value(v: Value) -> bytes:
    """An `AnyValue` message: string 1, bool 2, int64 3, double 4."""
    if isinstance(v, bool):  # before int: a bool is an int
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        return b"\x18" + varint(v)
    if isinstance(v, float):
        return b"\x21" + _DOUBLE.pack(v)
    return field(1, v.encode())


def key_value(key: str, v: Value) -> bytes:
    """A `KeyValue` message: key 1, value 2."""
    return field(1, key.encode()) + field(2, any_value(v))


class Encoder:
    """Spans and whole export requests for one resource (the gateway process) and scope.

    Attributes come in two kinds: `group`, a tuple of low-cardinality pairs (the model, the
    backend, the status) encoded once and then found by the tuple; `number`, one value that
    varies per request (tokens, the time to first token), encoded each time. A key must
    keep one value type (True == 1 as a dict key)."""

    def __init__(self, resource: Sequence[tuple[str, Value]], scope: str, version: str) -> None:
        res = b"".join(field(1, key_value(k, v)) for k, v in resource)
        self._resource = field(1, res)  # ResourceSpans.resource
        self._scope = field(1, field(1, scope.encode()) + field(2, version.encode()))
        self._groups: dict[tuple[tuple[str, Value], ...], bytes] = {}
        self._heads: dict[tuple[str, int], bytes] = {}  # (key, value size): see `number`
        self._names: dict[tuple[str, int], bytes] = {}

    def group(self, pairs: tuple[tuple[str, Value], ...]) -> bytes:
        """The span fields `attributes` (9) of `pairs`, encoded once per distinct tuple."""
        hit = self._groups.get(pairs)
        if hit is None:
            if len(self._groups) >= MAX_CACHED:
                self._groups.clear()
            hit = b"".join(field(9, key_value(k, v)) for k, v in pairs)
            self._groups[pairs] = hit
        return hit

    def number(self, key: str, v: int | float) -> bytes:
        """The span field `attributes` (9) holding `key: v` (int64 or double): everything
        before the value's own bytes depends only on the key and the value's size."""
        if type(v) is int:
            vb = varint(v)
            head = self._heads.get((key, len(vb)))
            if head is None:
                head = self._heads[(key, len(vb))] = _number_head(key, b"\x18", len(vb))
            return head + vb
        head = self._heads.get((key, 0))
        if head is None:
            head = self._heads[(key, 0)] = _number_head(key, b"\x21", 8)
        return head + _DOUBLE.pack(v)

    def span(
        self,
        trace_id: bytes,
        span_id: int,
        parent_id: int,
        name: str,
        kind: int,
        start_ns: int,
        end_ns: int,
        attributes: bytes,
        status: int = UNSET,
        message: str | None = None,
        flags: int = 1 | HAS_IS_REMOTE,
    ) -> bytes:
        """One `Span` message, wrapped as the field `spans` of `ScopeSpans`. `trace_id`: its
        16 bytes; `attributes`: from `group` and `number`, joined."""
        nf = self._names.get((name, kind))
        if nf is None:
            if len(self._names) >= MAX_CACHED:
                self._names.clear()
            nf = self._names[(name, kind)] = field(5, name.encode()) + b"\x30" + varint(kind)
        body = (
            b"\x0a\x10"  # trace_id 1: 16 bytes
            + trace_id
            + b"\x12\x08"  # span_id 2: 8 bytes
            + span_id.to_bytes(8, "big")
            + (b"\x22\x08" + parent_id.to_bytes(8, "big") if parent_id else b"")  # parent 4
            + nf  # name 5, kind 6
            + b"\x39"  # start_time_unix_nano 7, fixed64
            + _FIXED64.pack(start_ns)
            + b"\x41"  # end_time_unix_nano 8, fixed64
            + _FIXED64.pack(end_ns)
            + attributes
            + b"\x85\x01"  # flags 16, fixed32
            + _FIXED32.pack(flags)
        )
        if status:
            st = (field(2, message.encode()) if message else b"") + b"\x18" + varint(status)
            body += field(15, st)
        return field(2, body)  # ScopeSpans.spans 2

    def request(self, spans: Iterable[bytes]) -> bytes:
        """The `ExportTraceServiceRequest` of `spans` (each from `span`)."""
        scope_spans = field(2, self._scope + b"".join(spans))
        return field(1, self._resource + scope_spans)


def _number_head(key: str, tag: bytes, size: int) -> bytes:
    """What precedes a number's `size` value bytes in the span field `attributes`: the
    field's tag and length, the KeyValue's key, its value's tag and length, the AnyValue's
    tag (`tag`: int64 or double)."""
    kf = field(1, key.encode())
    kv_len = len(kf) + 2 + 1 + size  # key, value tag + length (one byte), AnyValue tag, value
    return b"\x4a" + varint(kv_len) + kf + b"\x12" + bytes((1 + size,)) + tag


class CollectorError(Exception):
    """The collector did not take a batch: why, in words (never the URL's query)."""


class Collector:
    """POSTs export requests to an OTLP/HTTP endpoint; one connection, kept alive."""

    def __init__(self, endpoint: str, timeout: float) -> None:
        u = urlsplit(endpoint)
        self.https = u.scheme == "https"
        self.host = u.hostname or ""
        self.port = u.port or (443 if self.https else 80)
        self.path = (u.path or "/v1/traces") + (f"?{u.query}" if u.query else "")
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self.https:
            ctx = ssl.create_default_context()
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=self.timeout, context=ctx
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def send(self, body: bytes) -> None:
        """POST one export request; raises `CollectorError`. A kept-alive connection the
        collector closed meanwhile is retried once on a fresh one."""
        for fresh in (self._conn is None, True):
            if self._conn is None:
                self._conn = self._connect()
            try:
                self._conn.request(
                    "POST",
                    self.path,
                    body,
                    {"content-type": "application/x-protobuf", "user-agent": "pulsegate"},
                )
                resp = self._conn.getresponse()
                resp.read()
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if fresh:
                    raise CollectorError(f"{type(e).__name__}: {e}") from None
                continue
            if resp.will_close:
                self.close()
            if not 200 <= resp.status < 300:
                raise CollectorError(f"HTTP {resp.status}")
            return

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


__all__ = ["CLIENT", "ERROR", "SERVER", "UNSET", "Collector", "CollectorError", "Encoder"]
