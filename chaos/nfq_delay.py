"""A delay line on an NFQUEUE: netem's `delay D jitter J`, which this kernel lacks.

    ip netns exec pgx-rtr python -m chaos.nfq_delay --queue 10 --delay-ms 60 --jitter-ms 20

Packets queued by `iptables ... -j NFQUEUE --queue-num N --queue-bypass` are released after
D +- J ms (uniform), in arrival order (each release time is at least the previous one, as a
real link never reorders): the jitter is what one packet waits for the one before it. Runs
in FORWARD of the router namespace (never in a sender's OUTPUT, where TCP Small Queues would
count the held packets as unsent). On SIGTERM every held packet is released at once, so
lifting the fault loses nothing; with the process gone, `--queue-bypass` passes packets
through undelayed. Prints `nfq_delay ready` once bound.
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import threading
import time

import fnfqueue


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--queue", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, required=True)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    delay, jitter = args.delay_ms / 1e3, args.jitter_ms / 1e3

    conn = fnfqueue.Connection()
    q = conn.bind(args.queue)
    q.set_mode(0xFFFF, fnfqueue.COPY_META)  # the verdict needs no payload copy
    q.set_maxlen(8192)
    held: collections.deque[tuple[float, fnfqueue.Packet]] = collections.deque()
    cond = threading.Condition()
    stopping = threading.Event()

    def release() -> None:
        while True:
            with cond:
                while not held and not stopping.is_set():
                    cond.wait()
                if not held:
                    return
                due, pkt = held[0]
                wait = due - time.monotonic()
                if wait > 0 and not stopping.is_set():
                    cond.wait(wait)
                    continue
                held.popleft()
            try:
                pkt.accept()
            except Exception:  # the kernel forgot it (queue flushed): nothing to do
                pass

    def on_term(_sig: int, _frm: object) -> None:
        stopping.set()
        with cond:
            cond.notify_all()
        releaser.join(5)
        raise SystemExit(0)

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print("nfq_delay ready", flush=True)
    last = 0.0
    for pkt in conn:
        due = time.monotonic() + delay + rng.uniform(-jitter, jitter)
        due = max(due, last)
        last = due
        with cond:
            held.append((due, pkt))
            cond.notify()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
