"""The health core (pure: no I/O, no clock, no asyncio): observations in, verdicts out.

Modules, one concept each: `observations` (inputs), `ewma` (smoothing), `signals` (per-backend
numbers), `score` (0-100 score and routing weight), `machine` (the state table and the event a
hard failure fires), `conditions` (thresholds as predicates), `rules` (which event fires),
`evaluation` (the periodic judgement), `evidence` (readiness and rejoin evidence), `suspect`
(first bytes overdue), `backoff` (ejection backoff), `probation` (ramp), `auto_limit`
(`max_inflight: auto`), `weighing` (verdict numbers), `standing` (state and cached verdict),
`cadence` (probe intervals), `events` (transition records), `backend` (one backend: folds
observations in, applies the rules), `fleet` (all backends, routable verdicts, panic),
`verdict` (the output).
"""
