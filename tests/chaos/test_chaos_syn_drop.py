"""The chaos lab's `syn_drop` against pulsegate (issue #21, item 3): TCP SYNs to one node
dropped in the router namespace while its established connections keep working. It must be
ejected with cause `connect` while the fault is held (6 s), with no client error and nothing
sent to it once out. How fast is a figure, not an assert: docs/connect-evidence.md (~1.1-1.7 s).
About 40 s.
"""

from __future__ import annotations

import pytest
from chaos.faults import BY_KEY
from chaos.lab import Lab
from chaos.scenario import Settings, run
from chaos.tap import Tap

pytestmark = pytest.mark.slow


async def test_syn_drop_is_detected_by_connect_evidence(lab: Lab) -> None:
    """SYNs dropped to one node: ejected for `connect`, 0 client errors, 0 sent after."""
    fault = BY_KEY["syn_drop"]
    settings = Settings(rate=30.0, pre=1.5, hold_scale=6.0 / fault.hold, recover_max=0.0)
    tap = Tap().start()
    try:
        r = await run(lab, fault, "pulsegate", settings, tap, seed=7)
    finally:
        tap.stop()
    assert r["ok"], r.get("error")
    assert r["detected"], f"not ejected during the hold; events: {r['events']}"
    assert r["detection_cause"] == "connect", r["detection_reason"]
    print(f"syn_drop: ejected after {r['detection_s']} s")
    assert r["client_errors"] == 0, r["error_kinds"]
    assert r["requests_during_fault"] > 50
    assert r["sent_after_detection"] == 0
