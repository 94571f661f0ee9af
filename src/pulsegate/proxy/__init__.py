"""The I/O shell in front of clients: parse little, pick a backend, forward bytes, report."""
