"""A worker's FleetMirror answers the proxy's questions exactly as the Fleet would."""

from __future__ import annotations

import pickle

from health.harness import Harness
from pulsegate.cluster.mirror import FleetMirror, export
from pulsegate.health.observations import Outcome, RequestResult


def test_the_mirror_reads_like_the_fleet_after_a_pickle_round_trip() -> None:
    """routable, serves, models, backend_models, state and usual TTFT match the fleet's."""
    h = Harness(models=("m", "n"))
    h.make_ready()
    h.run(30.0, h.healthy_traffic())
    h.fleet.drain("c", h.now)
    h.obs("a", RequestResult(Outcome.OK, ttft_s=0.2))
    mirror = FleetMirror()
    mirror.apply(pickle.loads(pickle.dumps(export(h.fleet, h.now))))
    f = h.fleet
    assert mirror.version == f.version
    for m in ("m", "n", "unknown"):
        assert mirror.routable(m) == f.routable(m)
        assert mirror.serves(m) == f.serves(m)
    assert mirror.models() == f.models()
    for name in "abc":
        assert mirror.backend_models(name) == f.backend_models(name)
        assert mirror.state(name) == f.state(name)
        assert mirror.usual_ttft(name, h.now) == f.usual_ttft(name, h.now)
    assert {v.name for v in mirror.routable("m")} == {"a", "b"}
