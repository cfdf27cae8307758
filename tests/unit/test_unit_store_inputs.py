"""The store's lock file, URIs with credentials, and files that are not stores: refused, not followed."""

import pytest

from titan_exp import ui
from titan_exp.compare import cli as compare_cli
from titan_exp.rules import ConfigError
from titan_exp.tracking.config import TrackingConfig, masked
from titan_exp.tracking.store import ensure_store


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_left_as_it_was(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (tmp_path / "mlflow.db.lock").symlink_to(target)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        ensure_store(TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db"))
    assert target.read_text() == "keep me\n"
    assert not (tmp_path / "mlflow.db").exists()


def test_a_password_in_the_uri_is_refused_and_never_echoed():
    uri = "http://alice:s3cret@mlflow.example:5000"
    assert masked(uri) == "http://alice:***@mlflow.example:5000"
    with pytest.raises(ConfigError) as err:
        TrackingConfig(uri=uri).check("tracking")
    assert "s3cret" not in str(err.value) and "MLFLOW_TRACKING_PASSWORD" in str(err.value)


@pytest.mark.parametrize("port", ["-1", "0", "99999"])
def test_ui_refuses_a_port_outside_the_range_in_one_line(port, capsys):
    assert ui.main(["--port", port]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and f"--port={port}: a port lies in 1-65535" in said[0]


@pytest.mark.parametrize("command", [ui.main, compare_cli.main])
def test_ui_and_compare_refuse_a_file_that_is_not_sqlite_in_one_line(tmp_path, capsys, command):
    not_a_store = tmp_path / "notes.db"
    not_a_store.write_text("these are notes, not a database\n")
    assert command(["--uri", f"sqlite:///{not_a_store}"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "is not a SQLite database" in said[0]


def test_ui_warns_before_serving_the_network(capsys):
    import socket

    with socket.socket() as taken:  # the port is busy, so no server starts: only what is said before
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert ui.main(["--host", "0.0.0.0", "--port", str(port)]) == 2
    said = capsys.readouterr().err
    assert "warning: --host=0.0.0.0 serves the UI to the network" in said
    assert ui.main(["--port", "-1"]) == 2 and "warning" not in capsys.readouterr().err
