"""The job API of a Ray cluster as the launching process talks to it (launchers/ray.py): Ray's own
client, every request bounded (seconds to connect, seconds to wait for an answer, bytes of an
answer), so that an address that takes a connection and never answers, or answers without end, is
refused or fails the job in one line rather than hanging. Imports ray: imported when a job asks
for launcher=ray."""

import logging
import os
import socket
import time
import warnings
from typing import Any
from urllib.parse import urlsplit

from ray.job_submission import JobSubmissionClient

# Seconds to connect to the address. Then, for its first answer (whether a cluster answers at all,
# before anything is written), and for each later one (a busy dashboard may be slow while a job
# runs; past them the job fails, as when its cluster went away): seconds to wait for the answer to
# start, and to read all of it.
CONNECT_TIMEOUT_S = 5.0
FIRST_ANSWER_S = (10.0, 10.0)
ANSWER_S = (60.0, 300.0)
# The largest answer taken (a job's whole log is one).
MAX_ANSWER_BYTES = 256 << 20

_CLIENTS: dict[str, Any] = {}


class BoundedJobClient(JobSubmissionClient):
    """Ray's job API client whose every request is bounded (Ray's sets no timeout: requests waits
    forever for an answer, and reads an answer to its end whatever its size)."""

    def __init__(self, address: str | None):
        self.answer_s = FIRST_ANSWER_S  # Ray's __init__ asks for the cluster's version
        super().__init__(address)
        self.answer_s = ANSWER_S

    def _do_request(self, method: str, endpoint: str, **kwargs: Any):
        start_s, read_s = self.answer_s
        kwargs.setdefault("timeout", (CONNECT_TIMEOUT_S, start_s))
        kwargs.setdefault("hooks", {"response": lambda response, **_: _read_bounded(response, read_s)})
        return super()._do_request(method, endpoint, **kwargs)


class AnswerTooLarge(ConnectionError):
    """An answer of the job API larger than MAX_ANSWER_BYTES, or slower to read than allowed."""


def _read_bounded(response, read_s: float) -> None:
    """As requests' response hook, before it reads the body: read it here, bounded, and keep it as
    the body requests hands on (`_content`, where it keeps what it read)."""
    body, deadline = bytearray(), time.monotonic() + read_s
    for chunk in response.raw.stream(1 << 16, decode_content=True):
        body += chunk
        if len(body) > MAX_ANSWER_BYTES or time.monotonic() > deadline:
            response.close()
            raise AnswerTooLarge(
                f"the job API at {response.url} answered more than {MAX_ANSWER_BYTES >> 20} MiB "
                f"or for longer than {read_s:g} s"
            )
    response._content, response._content_consumed = bytes(body), True


def client(address: str) -> BoundedJobClient:
    """The job API client of the cluster at `address` (one per address and process: connecting
    asks the cluster for its version)."""
    if address not in _CLIENTS:
        # Its INFO lines (packages uploaded, the log stream closed, Ray Client's connection) are
        # not the job's.
        for name in (
            "ray.dashboard.modules.job.sdk",
            "ray.dashboard.modules.dashboard_sdk",
            "ray._private",
            "ray.client_builder",
            "ray.util.client",
        ):
            logging.getLogger(name).setLevel(logging.WARNING)
        if address.startswith("ray://"):
            _check_reachable(address)
        # Ray's client takes RAY_API_SERVER_ADDRESS or RAY_ADDRESS over the address it is given:
        # only `auto` reads them here.
        names = () if address == "auto" else ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
        saved = {name: os.environ.pop(name) for name in names if name in os.environ}
        try:
            with warnings.catch_warnings():  # Ray Client's timeout warning says what the refusal says
                warnings.simplefilter("ignore", UserWarning)
                _CLIENTS[address] = BoundedJobClient(None if address == "auto" else address)
        finally:
            os.environ.update(saved)
    return _CLIENTS[address]


def _check_reachable(address: str) -> None:
    """A Ray Client address (ray://HOST:PORT) takes a connection within CONNECT_TIMEOUT_S: Ray's
    own client tries for ~30 s before it gives up on one that refuses it."""
    parts = urlsplit(address)
    try:
        port = parts.port or 10001  # Ray Client's default port
        socket.create_connection((parts.hostname or "", port), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as err:  # ValueError: a port that is not a number
        raise ConnectionError(f"Failed to connect to Ray Client at {address}: {err}") from None
