"""The front door (`auth:`): client keys (`keys.py`), per-key limits (`limits.py`, pure) and
the `proxy.exchange.Door` over them (`door.py`). See docs/front-door.md."""
