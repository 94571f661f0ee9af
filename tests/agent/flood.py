"""A hostile heartbeat client, run as its own process by the flood test so that its CPU is not
the measuring test's: one stream, MICRO_INFERENCE pings at `rate` a second for `seconds`,
pongs read as they come. Prints ``sent=N busy=B other=O`` when done.

    python flood.py PORT TOKEN RATE SECONDS
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

import grpc

from pulsegate.agent.wire import heartbeat_stub, pb


async def main(port: int, token: str, rate: float, seconds: float) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = heartbeat_stub(channel).Stream(metadata=(("authorization", f"Bearer {token}"),))
        counts = {"busy": 0, "other": 0}
        sent = 0
        all_in = asyncio.Event()
        writing = True

        async def reader() -> None:
            while True:
                pong = await call.read()
                if pong is grpc.aio.EOF:
                    return
                counts["busy" if pong.busy else "other"] += 1
                if not writing and counts["busy"] + counts["other"] >= sent:
                    all_in.set()

        task = asyncio.create_task(reader())
        t0 = time.monotonic()
        while (elapsed := time.monotonic() - t0) < seconds:
            due = int(elapsed * rate)
            while sent < due:  # paced: catch up to the rate, then yield to the reader
                sent += 1
                await call.write(pb.Ping(seq=sent, kind=pb.Ping.MICRO_INFERENCE, timeout_ms=60_000))
            await asyncio.sleep(0.005)
        writing = False
        if counts["busy"] + counts["other"] >= sent:
            all_in.set()
        with contextlib.suppress(TimeoutError):  # the last busy answers, then the real pong
            await asyncio.wait_for(all_in.wait(), timeout=5.0)
        await call.done_writing()
        task.cancel()
        print(f"sent={sent} busy={counts['busy']} other={counts['other']}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])))
