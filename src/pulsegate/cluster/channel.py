"""The local channel between the primary and one worker: a socketpair, framed messages.

A frame is a 4-byte big-endian length and a pickle of one message below. Pickle because
both ends are the same program started by the same user on one socketpair that nobody
else can reach (no file-system path), and the messages hold the core's own frozen
dataclasses (`Config`, `Verdict`, observations) that pickle round-trips unchanged.

Primary -> worker: `Hello` (once, first), `ViewUpdate` on every change of the fleet's
verdicts, `Ejected` at once on each ejection (the worker cuts that backend's waits for a
first byte and tightens its live streams' watchdogs), `Stop` (drain and exit).
Worker -> primary: `Ready` once listening, `Outcomes` (request results, first-byte-overdue
and stream-broken evidence, in order) and `Stats` (cumulative proxy metrics) on short timers.
Writes never wait: a frame is queued on the transport and the loop moves on.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from pulsegate.cluster.mirror import View
from pulsegate.config import Config
from pulsegate.health.observations import Observation, Outcome, RequestResult

_LEN = struct.Struct("!I")
MAX_FRAME = 64 * 1024 * 1024


class ChannelClosed(Exception):
    """The other end went away (EOF or a broken frame)."""


@dataclass(frozen=True, slots=True)
class Hello:
    config: Config
    slot: int
    port: int  # the gateway's port, resolved (the config may say 0)
    admin_socket: str  # the primary's private HTTP listener (admin, metrics, dashboard)
    rows: int  # worker slots in the in-flight table
    columns: dict[str, int]  # backend -> its column in the in-flight table
    capacity: int  # the table's columns, used or not (backends a reload may add)
    view: View


@dataclass(frozen=True, slots=True)
class Reload:
    """The primary took a new config: the worker takes it too (`Worker.apply`), with the
    in-flight table's columns for the new backend list."""

    config: Config
    columns: dict[str, int]


@dataclass(frozen=True, slots=True)
class ViewUpdate:
    view: View


@dataclass(frozen=True, slots=True)
class Ejected:
    backend: str
    cause: str


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Ready:
    pid: int


@dataclass(frozen=True, slots=True)
class Outcomes:
    """Observations in the order they were made, each packed by `pack`."""

    items: list[tuple[Any, ...]]


# Pickling a slotted dataclass goes through copyreg and costs ~15 µs; a request result, one
# per client request, travels as a plain tuple instead (~0.2 µs).
_OUTCOMES = list(Outcome)
_OUTCOME_INDEX = {o: i for i, o in enumerate(_OUTCOMES)}


def pack(name: str, obs: Observation) -> tuple[Any, ...]:
    if type(obs) is RequestResult:
        return (name, _OUTCOME_INDEX[obs.outcome], obs.ttft_s, obs.status)
    return (name, obs)


def unpack(item: tuple[Any, ...]) -> tuple[str, Observation]:
    if len(item) == 4:
        return item[0], RequestResult(_OUTCOMES[item[1]], item[2], item[3])
    return item[0], item[1]


@dataclass(frozen=True, slots=True)
class Stats:
    """A worker's cumulative proxy metrics (see cluster/metrics.py) and a few facts about it."""

    metrics: dict[str, dict[Any, Any]]
    queue_depth: int
    view_lag_s: float  # the last view's export-to-applied delay


def encode(msg: object) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


def send(writer: asyncio.StreamWriter, msg: object) -> None:
    """Queue one frame (never waits; a closed channel drops it)."""
    send_frame(writer, encode(msg))


def send_frame(writer: asyncio.StreamWriter, frame: bytes) -> None:
    """Queue a frame made by `encode` (one encoding for many workers)."""
    if not writer.is_closing():
        writer.write(frame)


async def receive(reader: asyncio.StreamReader) -> object:
    """The next message; raises ChannelClosed at EOF."""
    try:
        head = await reader.readexactly(_LEN.size)
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:
            raise ChannelClosed(f"frame of {n} bytes")
        return pickle.loads(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise ChannelClosed(str(e)) from e
