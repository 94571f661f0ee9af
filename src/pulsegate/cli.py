"""The one entry point: `pulsegate serve|epp|reload|demo|sim|agent|status|check|key`.

Each subcommand imports its module lazily so `pulsegate check` stays fast and a missing
optional dependency only breaks the command that needs it.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pulsegate", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the gateway")
    s.add_argument("-c", "--config", required=True, help="YAML config file")
    s.add_argument(
        "--replace",
        type=int,
        metavar="PID",
        help="take over from the gateway PID: listen beside it, judge every backend, "
        "then make it drain and exit (nothing in flight is lost)",
    )

    s = sub.add_parser("epp", help="run as an Envoy endpoint picker (ext_proc gRPC)")
    s.add_argument("-c", "--config", required=True, help="YAML config file")
    s.add_argument("--listen", default="127.0.0.1:9002", help="gRPC HOST:PORT")
    s.add_argument(
        "--admin",
        action="store_true",
        help="also serve /healthz, /metrics, the admin API and the dashboard on the "
        "config's gateway.listen (the rules of serve's)",
    )
    s.add_argument(
        "--xds",
        metavar="HOST:PORT",
        default=None,
        help="also be Envoy's EDS server on HOST:PORT: verdicts pushed as endpoint health "
        "and weights, one cluster per model, nothing per request (docs/epp.md, EDS mode)",
    )

    s = sub.add_parser("reload", help="make a running gateway re-read its config file")
    s.add_argument("--url", default="http://127.0.0.1:8080")
    s.add_argument("--token-env", default="PULSEGATE_ADMIN_TOKEN")

    s = sub.add_parser("demo", help="simulated fleet + gateway + traffic + a fault cycle")
    s.add_argument("--port", type=int, default=8080, help="gateway port (0: any free port)")
    s.add_argument("--duration", type=float, default=None, help="stop after N seconds")
    s.add_argument("--fault-after", type=float, default=15.0, help="seconds before each fault")
    s.add_argument("--fault-hold", type=float, default=15.0, help="seconds each fault lasts")
    s.add_argument("--no-agents", action="store_true", help="no heartbeat agents")
    s.add_argument("--replicas", type=int, default=1,
                   help="N gateway replicas, one redis-server (docs/replicas.md)")  # fmt: skip
    s.add_argument(
        "--data-plane",
        choices=("pulsegate", "envoy"),
        default="pulsegate",
        help="envoy: Envoy in front, pulsegate as its endpoint picker (docs/epp.md)",
    )

    s = sub.add_parser("sim", help="one simulated OpenAI-compatible engine")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--name", default="sim")
    s.add_argument("--model", default="demo-7b")
    s.add_argument("--ttft-ms", type=float, default=30.0)
    s.add_argument("--itl-ms", type=float, default=10.0)
    s.add_argument("--max-batch", type=int, default=32)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--gpu-total-mb", type=float, default=81920.0)

    s = sub.add_parser("agent", help="the node-side heartbeat agent")
    s.add_argument("--engine", required=True, help="engine base URL, e.g. http://127.0.0.1:8000")
    s.add_argument("--listen", default="127.0.0.1:50051")
    s.add_argument("--gpu", default="auto", help="auto | nvml | dcgm=URL | engine | none")
    s.add_argument(
        "--model", default=None, help="model for micro-inference (default: first listed)"
    )
    s.add_argument(
        "--token-env",
        default=None,
        metavar="VAR",
        help="environment variable holding the shared token every stream must present",
    )
    s.add_argument(
        "--micro-timeout",
        type=float,
        default=2.0,
        metavar="S",
        help="longest micro-inference in seconds; a caller's timeout_ms is clipped to it",
    )
    s.add_argument(
        "--max-streams", type=int, default=16, help="most heartbeat streams open at once"
    )
    s.add_argument(
        "--api",
        default="completions",
        choices=("completions", "chat", "embeddings"),
        help="the engine endpoint micro-inferences use (embeddings: an embedding model)",
    )
    s.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve TLS only")
    s.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    s.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="PEM CA: require a client certificate it signed (mutual TLS)",
    )

    s = sub.add_parser("status", help="table of backends")
    s.add_argument("--url", default="http://127.0.0.1:8080")
    s.add_argument("--watch", action="store_true", help="refresh every second")
    s.add_argument("--token-env", default="PULSEGATE_ADMIN_TOKEN")

    s = sub.add_parser("check", help="validate a config file")
    s.add_argument("-c", "--config", required=True)

    s = sub.add_parser("key", help="client keys of the front door (auth:)")
    ks = s.add_subparsers(dest="key_cmd", required=True)
    k = ks.add_parser("new", help="print a fresh key once, and its keys-file entry (sha256 only)")
    k.add_argument("name", help="the key's name (metrics, access log, errors show it)")
    k.add_argument("--models", nargs="+", default=[], metavar="M", help="model globs allowed")
    k.add_argument("--rpm", type=int, default=0, help="requests per minute (0: no limit)")
    k.add_argument("--tpm", type=int, default=0, help="tokens per minute (0: no limit)")
    return p


def _key_new(name: str, models: list[str], rpm: int, tpm: int) -> int:
    from pulsegate.config.values import _NAME
    from pulsegate.front.keys import entry_yaml, new_key

    if not _NAME.match(name) or rpm < 0 or tpm < 0:
        print(
            "error: NAME must be 1-63 letters, digits, '_', '.' or '-'; --rpm and --tpm >= 0",
            file=sys.stderr,
        )
        return 2
    key = new_key()
    # The key goes to stdout once, never to a file or log; the entry holds its digest only.
    print(f"key (shown once, give it to the client): {key}")
    print("keys-file entry (paste under `keys:`):")
    print(entry_yaml(name, key, models, rpm, tpm))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "check":
        from pulsegate.config import ConfigError, load_config

        try:
            cfg = load_config(args.config)
        except ConfigError as e:
            for err in e.errors:
                print(f"error: {err}", file=sys.stderr)
            return 2
        keys = f", {len(cfg.auth.keys)} client key(s)" if cfg.auth is not None else ""
        print(f"ok: {len(cfg.backends)} backend(s){keys}")
        return 0
    if args.cmd == "key":
        return _key_new(args.name, args.models, args.rpm, args.tpm)
    if args.cmd == "serve":
        from pulsegate.server import serve

        return serve(args.config, args.replace)
    if args.cmd == "epp":
        try:
            from pulsegate.epp.run import run_epp
        except ImportError as e:  # Envoy's stubs come with the `epp` extra (xds-protos)
            print(f"pulsegate epp needs the 'epp' extra: pip install 'pulsegate[epp]' ({e})",
                  file=sys.stderr)  # fmt: skip
            return 2
        return run_epp(args.config, args.listen, args.admin, args.xds)
    if args.cmd == "reload":
        from pulsegate.status import run_reload

        return run_reload(url=args.url, token_env=args.token_env)
    if args.cmd == "sim":
        from pulsegate.sim.server import SimOptions, run_sim

        return run_sim(
            SimOptions(
                host=args.host,
                port=args.port,
                name=args.name,
                model=args.model,
                ttft_ms=args.ttft_ms,
                itl_ms=args.itl_ms,
                max_batch=args.max_batch,
                seed=args.seed,
                gpu_total_mb=args.gpu_total_mb,
            )
        )
    if args.cmd == "agent":
        from pulsegate.agent.server import run_agent

        return int(
            run_agent(
                engine=args.engine,
                listen=args.listen,
                gpu=args.gpu,
                model=args.model,
                token_env=args.token_env,
                micro_timeout=args.micro_timeout,
                max_streams=args.max_streams,
                tls_cert=args.tls_cert,
                tls_key=args.tls_key,
                tls_client_ca=args.tls_client_ca,
                api=args.api,
            )
        )
    if args.cmd == "status":
        from pulsegate.status import run_status

        return run_status(url=args.url, watch=args.watch, token_env=args.token_env)
    if args.cmd == "demo" and args.data_plane == "envoy":
        from pulsegate.epp.demo import run_envoy_demo

        return run_envoy_demo(
            args.port, args.duration, args.fault_after, args.fault_hold, not args.no_agents
        )
    if args.cmd == "demo" and args.replicas > 1:
        from pulsegate.demo_replicas import run_replicas_demo

        return run_replicas_demo(
            args.port, args.duration, args.fault_after, args.fault_hold, not args.no_agents,
            args.replicas,
        )  # fmt: skip
    if args.cmd == "demo":
        from pulsegate.demo import run_demo

        return run_demo(
            args.port, args.duration, args.fault_after, args.fault_hold, not args.no_agents
        )
    return 2
