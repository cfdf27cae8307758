"""`titan_exp ui` (or `python -m titan_exp ui`): the MLflow UI for the project's store on 127.0.0.1.

titan_exp ui                     # http://127.0.0.1:5000 over outputs/mlflow.db
titan_exp ui --port 5001 --uri sqlite:////path/to/mlflow.db
titan_exp ui --print-link        # only the links to the latest sweep's comparison (a server runs already)
titan_exp ui --open              # and open it in a browser

Once the server answers, it prints a link that opens MLflow's model-training runs table on the
latest sweep's points, the strategy columns shown and sorted by TPS/device (compare/ui_view.py).
"""

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import webbrowser

from titan_exp.compare.ui_view import CHARTS_VIEW, comparison_link
from titan_exp.tracking.config import Store, TrackingConfig, masked
from titan_exp.tracking.store import client, create_store, not_a_store, server_answers

# How long the server may take to answer (about 8 s on 2 busy cores) before it is given up.
_START_TIMEOUT_S = 120.0
# How long the server may take to stop when asked before it is killed.
_STOP_TIMEOUT_S = 10.0


def server_command(backend_uri: str, host: str, port: int) -> list[str]:
    """`mlflow server` over a store, one worker (a UI for one person, not a fleet's tracking
    server) whose page opens on MLflow's model-training view (compare/ui_app.py); for a SQLite
    store, uploaded artifacts land beside the database."""
    store = Store.parse(backend_uri)
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        store.uri,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
        "--app-name",
        "titan_exp",
    ]
    if store.db is not None:
        store.db.parent.mkdir(parents=True, exist_ok=True)
        command += ["--artifacts-destination", str(store.db.parent / "mlartifacts")]
    return command


def _refused(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, in one line (None: nothing)."""
    if not 1 <= args.port <= 65535:
        return f"--port={args.port}: a port lies in 1-65535"
    try:
        store = Store.parse(args.uri)
    except ValueError as err:
        return f"--uri={masked(args.uri)}: {err}"
    if store.db is not None and (why := not_a_store(store.db)):
        return f"--uri={args.uri}: {why}"
    return None


def main(argv: list[str] | None = None) -> int:
    defaults = TrackingConfig()
    parser = argparse.ArgumentParser(prog="titan_exp ui", description=__doc__.split("\n\n")[0])
    parser.add_argument("--uri", default=defaults.uri, help=f"the store (default {defaults.uri})")
    parser.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on (default %(default)s: this machine only)"
    )
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--experiment", default=defaults.experiment, help="whose comparison the link opens")
    parser.add_argument("--print-link", action="store_true", help="print the link and exit (start no server)")
    parser.add_argument("--open", action="store_true", help="open the link in a browser once the server is up")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if refused := _refused(args):
        print(f"titan_exp ui: {refused}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.print_link:
        print(
            f"titan_exp ui: warning: --host={args.host} serves the UI to the network, and MLflow asks no one "
            "for a password here: anyone who reaches this machine can read and change the runs",
            file=sys.stderr,
        )
    base_url = f"http://{args.host}:{args.port}"
    if args.print_link:
        if link := _link(args.uri, base_url, args.experiment):
            print(f"{link}\n{link}{CHARTS_VIEW}")
            return 0
        print(f"titan_exp ui: no experiment {args.experiment!r} in {masked(args.uri)}", file=sys.stderr)
        return 1
    busy = _why_not_free(args.host, args.port)
    if busy:
        print(f"titan_exp ui: --port={args.port}: {args.host}:{args.port} {busy}; pick another port", file=sys.stderr)
        return 2
    return _serve(args, base_url)


def _serve(args: argparse.Namespace, base_url: str) -> int:
    """Run the server until Ctrl-C (or SIGTERM), printing the links once it answers; no server
    process outlives this one."""
    store = Store.parse(args.uri)
    if store.db is not None:
        create_store(store.db)  # the server would create a new one in place, racing other processes
    signal.signal(signal.SIGTERM, _interrupt)
    server = _start(server_command(args.uri, args.host, args.port))
    try:
        link = _link(args.uri, base_url, args.experiment)  # while the server starts
        if why := _not_up(server, base_url):
            print(f"titan_exp ui: {why}", file=sys.stderr)
            return 1
        print(f"MLflow UI on {base_url} (Ctrl-C stops it)", flush=True)
        if link:
            print(f"the latest comparison: {link}\n  as charts: {link}{CHARTS_VIEW}", flush=True)
        if args.open and not webbrowser.open(link or base_url):
            print("titan_exp ui: no browser found here; open the link above", file=sys.stderr, flush=True)
        code = server.wait()
        print(f"titan_exp ui: the MLflow server stopped (exit status {code})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(server)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # a SIGTERM stops the server as Ctrl-C does


def _start(command: list[str]) -> subprocess.Popen:
    """The server in a session of its own, so that stopping it reaches every process it started;
    Linux sends it SIGTERM should this process die without stopping it (PR_SET_PDEATHSIG). What it
    says goes to stderr: stdout holds this command's lines (the links) only."""

    def die_with_us() -> None:
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)

    # Without MLflow's job runner (GenAI scoring, trace rollups: nothing this UI shows): it runs
    # its periodic tasks (online scoring, every minute) as processes in sessions of their own
    # (mlflow/server/jobs/local_executor.py), out of reach of stopping this one; one running at a
    # Ctrl-C outlived it, holding its output open.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return subprocess.Popen(
        command,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=sys.stderr.fileno(),
        preexec_fn=die_with_us,
        env=env,
    )


def _not_up(server: subprocess.Popen, base_url: str) -> str | None:
    """None once the server answers its health endpoint; why not if it ended or never answered."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while why := server_answers(base_url, 2.0):
        if (code := server.poll()) is not None:
            return f"the MLflow server ended (exit status {code}) before it answered on {base_url}; its output is above"
        if time.monotonic() > deadline:
            return f"the MLflow server did not answer within {_START_TIMEOUT_S:g} s ({why}); stopped it"
        time.sleep(0.2)
    return None


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to MLflow's command (it passes it on to its web server); whatever of its session is
    left after _STOP_TIMEOUT_S, killed."""
    if server.poll() is None:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(_STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def _link(uri: str, base_url: str, experiment: str) -> str | None:
    """The comparison link, where the store exists already (a new one has nothing to compare)."""
    store = Store.parse(uri)
    if store.db is not None and not store.db.exists():
        return None
    return comparison_link(client(store.uri), base_url, experiment)


def _why_not_free(host: str, port: int) -> str | None:
    """Why the server could not listen there, or None: found before the server starts, since a
    server that cannot bind only logs it and keeps its workers running for a while."""
    with socket.socket() as probe:
        # As the server binds (uvicorn sets SO_REUSEADDR): a port whose last server just stopped,
        # with its connections in TIME_WAIT, is free to it.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            probe.listen()
        except OSError as err:
            return f"cannot be listened on ({err.strerror})"
    return None
