"""TLS on the agent link: the agent's server files and the gateway's client context.

Plaintext stays the default (loopback, the tests, `make demo`). Off loopback, a pong is the
node's health as the gateway will believe it, so it must be neither readable nor forgeable
on the path: the agent serves TLS (``--tls-cert`` / ``--tls-key``) and, with
``--tls-client-ca``, requires a client certificate signed by that CA (mutual TLS); the
gateway's backend key ``agent_tls: {ca, cert, key, server_name}`` verifies the agent's
certificate and name and presents its own.

Both sides only read files here, with the standard library's `ssl` (no grpcio: the config
loader checks the gateway's files at load with the same functions). Each problem is a
`TlsSetupError` whose `role` (``"ca"``, ``"cert"``, ``"key"``, ``"client_ca"``) lets the
caller name it as a flag (``--tls-key``) or a key path (``backends[0].agent_tls.key``); the
message names the file, never its contents.

The client context (`client_context`): TLS 1.2 or later, the agent's certificate verified
against ``ca`` (the system's roots without one), its name checked (`check_hostname`: an IP
address is matched against the certificate's IP SANs), ALPN offering ``h2`` only. gRPC is
HTTP/2, and RFC 9113 3.3 says an h2 client over TLS must negotiate it with ALPN; an agent
that selects nothing is refused (`alpn_problem`) rather than spoken to in a protocol it did
not agree to. There is never a fallback to plaintext.

Files are read again at each dial, not once: a rotated certificate is used from the next
connection on, with no reload (a dial happens once per stream, not per ping).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import NoReturn

ALPN_H2 = "h2"


class TlsSetupError(ValueError):
    """A TLS file that cannot be used: `role` says which one (see the module docstring)."""

    def __init__(self, role: str, message: str) -> None:
        self.role = role
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class ServerFiles:
    """The agent's PEM files, read and checked (the key kept out of the repr)."""

    cert_chain: bytes
    key: bytes = field(repr=False)
    client_ca: bytes | None = None


def _no_passphrase() -> NoReturn:
    # Without this callback OpenSSL would prompt on the terminal for an encrypted key and
    # block a headless agent or gateway forever.
    raise TlsSetupError("key", "is an encrypted private key; give an unencrypted one")


def _read(role: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TlsSetupError(role, f"cannot read {path}: {e.strerror or e}") from e


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    # Each file is looked at first, so a wrong one is named as such rather than as
    # OpenSSL's "PEM lib" (which says neither which file nor what is wrong).
    if b"-----BEGIN CERTIFICATE-----" not in _read("cert", cert):
        raise TlsSetupError("cert", f"{cert} holds no PEM certificate")
    if b"PRIVATE KEY-----" not in _read("key", key):
        raise TlsSetupError("key", f"{key} holds no PEM private key")
    try:
        ctx.load_cert_chain(cert, key, password=_no_passphrase)
    except ssl.SSLError as e:
        code = getattr(e, "reason", None)
        if code == "KEY_VALUES_MISMATCH":
            raise TlsSetupError("key", f"{key} is not the private key of {cert}") from e
        raise TlsSetupError("key", f"{cert} + {key}: not usable ({code or e})") from e


def _load_ca(ctx: ssl.SSLContext, role: str, path: str) -> None:
    data = _read(role, path)
    try:
        ctx.load_verify_locations(cadata=data.decode("ascii", errors="replace"))
    except (ssl.SSLError, ValueError) as e:
        raise TlsSetupError(role, f"{path} holds no PEM CA certificate") from e


def client_context(
    ca: str | None = None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext:
    """The gateway's context for one agent: verify it against `ca` (None: the system's
    roots), present `cert` + `key` when given (mutual TLS), offer ALPN h2, TLS >= 1.2."""
    if (cert is None) != (key is None):
        raise TlsSetupError("key" if key is None else "cert", "cert and key go together")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols([ALPN_H2])
    if ca is not None:
        _load_ca(ctx, "ca", ca)
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if cert is not None and key is not None:
        _load_chain(ctx, cert, key)
    return ctx


def read_server_files(cert: str, key: str, client_ca: str | None = None) -> ServerFiles:
    """The agent's certificate chain, key and (mutual TLS) client CA, read and checked as a
    TLS server would load them, so a bad file stops the agent at start, by name."""
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(check, cert, key)
    ca = None
    if client_ca is not None:
        _load_ca(check, "client_ca", client_ca)
        ca = _read("client_ca", client_ca)
    return ServerFiles(_read("cert", cert), _read("key", key), ca)


def alpn_problem(ssl_object: object) -> str | None:
    """Why a finished handshake cannot carry gRPC (the agent did not select h2), or None."""
    selected = getattr(ssl_object, "selected_alpn_protocol", None)
    got = selected() if callable(selected) else None
    if got == ALPN_H2:
        return None
    return f"the agent did not select ALPN {ALPN_H2} (got {got or 'none'})"


def describe(exc: BaseException) -> str:
    """A short line for a TLS failure: OpenSSL's reason and verify message, no traceback."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    code = getattr(exc, "reason", None)  # set by OpenSSL; absent on a hand-made SSLError
    if isinstance(exc, ssl.SSLError) and code:
        reason = str(code).lower().replace("_", " ")
        if code == "WRONG_VERSION_NUMBER":  # what a plaintext HTTP/2 server answers
            return f"{reason}: the agent does not speak TLS (start it with --tls-cert/--tls-key)"
        return reason
    return str(exc) or type(exc).__name__
