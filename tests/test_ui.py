"""`titan_exp ui` refuses a port it cannot listen on, in one line, before any server starts (the
UI itself is checked in headless Chromium in test_tracking.py)."""

import socket
import subprocess
import sys
import time

from conftest import REPO


def test_busy_port_is_refused_in_one_line_and_starts_nothing(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        command = [
            sys.executable,
            "-m",
            "titan_exp",
            "ui",
            "--port",
            str(port),
            "--uri",
            f"sqlite:///{tmp_path}/mlflow.db",
        ]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, start_new_session=True)
    assert result.returncode == 2
    said = f"titan_exp ui: --port={port}: 127.0.0.1:{port} cannot be listened on (Address already in use)"
    assert result.stderr.strip().splitlines() == [f"{said}; pick another port"]
    assert time.monotonic() - start < 20 and not (tmp_path / "mlflow.db").exists()
