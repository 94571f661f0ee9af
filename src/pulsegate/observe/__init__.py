"""Metrics, events, alerts and the dashboard: how operators see what the gateway decided."""
