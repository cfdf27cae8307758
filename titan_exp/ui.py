"""`titan_exp ui` (or `python -m titan_exp ui`): the MLflow UI for the project's store on 127.0.0.1.

titan_exp ui                     # http://127.0.0.1:5000 over outputs/mlflow.db
titan_exp ui --port 5001 --uri sqlite:////path/to/mlflow.db
titan_exp ui --print-link        # only the links to the latest sweep's comparison (a server runs already)
titan_exp ui --open              # and open it in a browser

It prints a link that opens MLflow's model-training runs table on the latest sweep's points, the
strategy columns shown and sorted by TPS/device (compare/ui_view.py).
"""

import argparse
import os
import socket
import sys
import time
import webbrowser

from titan_exp.compare.ui_view import CHARTS_VIEW, comparison_link
from titan_exp.tracking.config import Store, TrackingConfig, masked
from titan_exp.tracking.store import client, not_a_store, server_answers


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
    command = server_command(args.uri, args.host, args.port)
    print(f"MLflow UI on {base_url} (Ctrl-C stops it)", flush=True)
    link = _link(args.uri, base_url, args.experiment)
    if link:
        print(f"the latest comparison: {link}\n  as charts: {link}{CHARTS_VIEW}", flush=True)
    if args.open:
        _open_once_up(base_url, link or base_url)
    os.execv(command[0], command)


def _link(uri: str, base_url: str, experiment: str) -> str | None:
    """The comparison link, where the store exists already (a new one has nothing to compare)."""
    store = Store.parse(uri)
    if store.db is not None and not store.db.exists():
        return None
    return comparison_link(client(store.uri), base_url, experiment)


def _open_once_up(base_url: str, link: str) -> None:
    """In a child process (this one becomes the server): wait for the server, then open `link` in a
    browser where one exists."""
    if os.fork():
        return
    try:
        deadline = time.monotonic() + 120
        while server_answers(base_url, 2.0) and time.monotonic() < deadline:
            time.sleep(0.5)
        if not webbrowser.open(link):
            print("titan_exp ui: no browser found here; open the link above", file=sys.stderr, flush=True)
    finally:
        os._exit(0)


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
