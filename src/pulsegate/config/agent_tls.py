"""A backend's `agent_tls` checked at load: the files readable and usable, cert with key.

    agent: 10.0.0.7:50051
    agent_tls: {ca: /etc/pulsegate/ca.pem, cert: gw.pem, key: gw.key, server_name: node-7}

The files are loaded into a TLS client context by the very function the heartbeat client
uses at each dial (`pulsegate.agent.tls.client_context`, standard library `ssl` only, no
I/O beyond reading them), so a file that passes here is one the heartbeat can use, and one
that does not is named by its key (``backends[2].agent_tls.key: ... is not the private key
of ...``) before the gateway starts or a reload takes it. This is the one place `config`
reads anything but its own file: a broken certificate found at the first dial would only
show as heartbeat misses.
"""

from __future__ import annotations

from pulsegate.agent.tls import TlsSetupError, client_context
from pulsegate.config.schema import AgentTlsConfig

Problem = tuple[str, str]


def agent_tls_problems(tls: AgentTlsConfig) -> list[Problem]:
    """What is wrong with `tls`, as (key under `agent_tls`, message) pairs."""
    problems: list[Problem] = []
    if tls.server_name is not None and not tls.server_name.strip():
        problems.append(("server_name", "must not be empty"))
    if (tls.cert is None) != (tls.key is None):
        missing = "key" if tls.key is None else "cert"
        other = "cert" if missing == "key" else "key"
        problems.append((missing, f"is required with agent_tls.{other} (mutual TLS needs both)"))
        return problems
    try:
        client_context(tls.ca, tls.cert, tls.key)
    except TlsSetupError as e:
        problems.append((e.role, str(e)))
    return problems
