"""pulsegate's chaos lab: real faults on a simulated fleet, measured against simpler gateways.

`python -m chaos.run` (make chaos) runs the suite, `python -m chaos.heartbeat` issue 5's agent
figures, `python -m chaos.cleanup` removes what a killed lab left. Method: docs/chaos.md.
"""
