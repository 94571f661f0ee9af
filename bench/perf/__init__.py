"""`make bench`: pulsegate beside a direct engine and nginx, on loopback, in one run.

Modules: `procs` (children started and stopped by PID, /proc accounting), `fleet` (engines,
pulsegate, nginx), `load` (wrk, fixed-rate and streaming clients), `report` (medians,
ratios, targets, JSON), `pyspy` (where pulsegate's time goes), `fast_engine` (an optional
httptools engine faster than the sim, so nginx is not capped by the backend).
"""
