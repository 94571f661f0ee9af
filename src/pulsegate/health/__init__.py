"""The health core (pure: no I/O, no clock, no asyncio): observations in, verdicts out.

Modules, one concept each: `observations` (inputs), `ewma` (smoothing), `signals` (per-backend
numbers), `score` (0-100 score and routing weight), `machine` (the state table), `ejection`
(backoff), `probation` (ramp), `events` (transition records), `backend` (the rules for one
backend), `fleet` (all backends, routable verdicts, panic), `verdict` (the output).
"""
