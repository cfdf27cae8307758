"""launcher=ray takes what comes back from a cluster as data (issue 68): a job API that is no Ray
cluster (tests/ray_fake_api.py, a real server on 127.0.0.1, talked to by Ray's real client through
the launcher's place and follow) can make the launching process run nothing, write nothing outside
the job's folder, and at worst end the run with one line. Also: launcher.runtime_env checked
before anything is submitted, every request to the address bounded, and a rank's result turned
into JSON where it ran."""

import base64
import json
import os
import pickle
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for ray_fake_api.py

from launchers import ray_client  # noqa: E402
from launchers.base import ConfigError, JobSpec, Placement  # noqa: E402
from launchers.entrypoint import Entrypoint  # noqa: E402
from launchers.ray import RayLauncher  # noqa: E402
from launchers.ray_messages import (  # noqa: E402
    MARKER,
    MAX_LINE_CHARS,
    RANK_LINE_PIECE_CHARS,
    Failure,
    MalformedMessage,
    Note,
    Refusal,
    Result,
    Unfinished,
    Unreadable,
    rank_lines,
    read_message,
    say,
)
from launchers.ray_rank import RankProcess  # noqa: E402
from launchers.rendezvous import free_port  # noqa: E402
from launchers.tasks import RankFailure  # noqa: E402
from titan_exp.config.compose import compose_job_config  # noqa: E402
from titan_exp.config.resolve import resolve  # noqa: E402
from titan_exp.job.launch import RUN_RANK  # noqa: E402
from titan_exp.job.result import RankResult  # noqa: E402

from ray_fake_api import FakeJobApi, message  # noqa: E402

RAY = ["launcher=ray", "launcher.device=cpu", "launcher.nproc_per_node=2"]


def placed_and_followed(api: FakeJobApi, folder: Path, echoed: list[str] | None = None, **options):
    """The job placed through the launcher's seam (2 ranks, the target launch.py places) at the
    fake job API, and followed: what follow returns."""
    from titan_exp.config.sections import LAUNCHER_SECTIONS

    section = LAUNCHER_SECTIONS["ray"](address=api.address, **options)
    spec = JobSpec("test", Placement("ray", "cpu", 1, 2, 1), 5, 60.0, resumable=False)
    said = echoed if echoed is not None else []
    return RayLauncher(section).place(RUN_RANK, None, spec, folder, said.append).follow()


class Runs:
    """Unpickled, it would run code: it leaves a file (the probe's payload ran os.system)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickled_result_in_the_log_is_never_unpickled(tmp_path):
    marker = tmp_path / "ran"
    payload = base64.b64encode(pickle.dumps(Runs(marker))).decode()
    assert not marker.exists()
    for line in (message(result=payload), message(kind="result", result=payload)):
        with FakeJobApi(log=line + "\n").running() as api, pytest.raises(MalformedMessage) as refused:
            placed_and_followed(api, tmp_path / "job")
        assert not marker.exists()
        assert len(str(refused.value).splitlines()) == 1
    # A result that is text stays text: nothing decodes it.
    with FakeJobApi(log=message(kind="result", result=payload) + "\n").running() as api:
        from titan_exp.config.sections import LAUNCHER_SECTIONS

        section = LAUNCHER_SECTIONS["ray"](address=api.address)
        spec = JobSpec("test", Placement("ray", "cpu", 1, 2, 1), 5, 60.0, resumable=False)
        placed = RayLauncher(section).place(lambda _: None, None, spec, tmp_path / "plain", print)
        assert placed.follow() == payload
    assert not marker.exists()


def test_a_rank_name_from_the_cluster_is_an_integer_of_the_world_and_no_path(tmp_path):
    folder = tmp_path / "a" / "job"
    for rank in ("../../x", "../../../x", 2, -1, True, 1.0):
        for line in (message(rank=rank, line="hi"), message(kind="line", rank=rank, line="hi")):
            with FakeJobApi(log=line + "\n").running() as api, pytest.raises(MalformedMessage):
                placed_and_followed(api, folder)
    assert sorted(path.name for path in tmp_path.rglob("*_log.out")) == []
    assert sorted(path.name for path in folder.iterdir()) == ["submit"]


# A line of the job's output that no driver writes, and what the refusal says of it.
MALFORMED = {
    "the probe's refusal": (message(refused={"nope": 1}), "no message kind of line, note"),
    "a refusal of other fields": (message(kind="refused", nope=1), "a refused message has the fields key, value, fix"),
    "a refusal whose fix is a table": (
        message(kind="refused", key="k", value="v", fix={"a": 1}),
        "refused.fix is dict, not str",
    ),
    "an unknown kind": (message(kind="bogus"), "no message kind"),
    "a kind that is a list": (message(kind=["line"]), "no message kind"),
    "not a JSON object": (MARKER + "[1, 2]", "no message kind"),
    "not JSON": (MARKER + "{nope", "not JSON"),
    "nested past the parser's depth": (MARKER + "[" * 200_000 + "]" * 200_000, "not JSON"),
    "a rank of 5000 digits": (MARKER + '{"kind": "line", "rank": ' + "9" * 5000 + ', "line": ""}', "not JSON"),
    "a rank that is true": (message(kind="line", rank=True, line="x"), "line.rank is bool, not int"),
    "a failure's reason of two lines": (
        message(kind="failure", rank=0, reason="a\nb"),
        "failure.reason holds a line break",
    ),
    "a failure of a rank past the world": (message(kind="failure", rank=9, reason="x"), "rank 9 is not one of"),
    "an ending whose timed_out is text": (message(kind="ended", why="x", timed_out="yes"), "is str, not bool"),
    "a result that is a list": (message(kind="result", result=[1]), "rank 0's result: not a table of metrics"),
    "a result whose metrics are a number": (
        message(kind="result", result={"metrics": 3}),
        "rank 0's result: its metrics are not a table of numbers",
    ),
    "a result whose metric is text": (
        message(kind="result", result={"metrics": {"loss": "low"}}),
        "rank 0's result: its metrics are not a table of numbers",
    ),
    "a result of another field": (message(kind="result", result={"exec": "rm"}), "rank 0's result: not a table of"),
    "a result whose stopped is a number": (
        message(kind="result", result={"stopped": 1}),
        "rank 0's result: its stopped is not text",
    ),
    "a line longer than the limit": (MARKER + "x" * (MAX_LINE_CHARS + 1), "a line longer than"),
    "a line of Ray's own past the limit": ("x" * (3 * MAX_LINE_CHARS), "a line longer than"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_message_ends_the_run_in_one_line_naming_what_is_wrong(case, tmp_path):
    line, says = MALFORMED[case]
    ended = "rank 0's result" in says  # the job's last word; others come while it runs, and stop it
    log = message(kind="line", rank=0, line="step 1") + "\n" + line + "\n"
    api = FakeJobApi(log=log, status="SUCCEEDED" if ended else "RUNNING")
    with api.running(), pytest.raises(MalformedMessage) as refused:
        placed_and_followed(api, tmp_path)
    said = str(refused.value)
    assert len(said.splitlines()) == 1 and len(said) < 300, said
    assert said.startswith("Ray job titan_exp-") and says in said, said
    assert api.status == ("SUCCEEDED" if ended else "STOPPED")


def test_a_well_formed_job_output_goes_to_each_ranks_log_and_its_result_is_rebuilt(tmp_path):
    long_line = "y" * (2 * RANK_LINE_PIECE_CHARS + 5)
    lines = [
        "a note of Ray's own",
        message(kind="note", note="ranks placed by Ray: ranks 0-1 on 10.0.0.2"),
        message(kind="line", rank=1, line="rank one"),
        *(MARKER + json.dumps({"kind": "line", **vars(piece)}) for piece in rank_lines(0, long_line)),
        message(kind="line", rank=0, line="step 1 loss 2.5"),
        message(kind="result", result={"metrics": {"loss": 2.5, "tps": 10}, "stopped": None}),
    ]
    echoed: list[str] = []
    with FakeJobApi(log="\n".join(lines) + "\n").running() as api:
        result = placed_and_followed(api, tmp_path, echoed)
    assert result == RankResult({"loss": 2.5, "tps": 10})
    assert (tmp_path / "1_log.out").read_text() == "rank one\n"
    rank0 = (tmp_path / "0_log.out").read_text().splitlines()
    assert "".join(rank0[:-1]) == long_line and rank0[-1] == "step 1 loss 2.5"
    assert max(len(line) for line in rank0) == RANK_LINE_PIECE_CHARS
    assert echoed[-1] == "step 1 loss 2.5" and "titan_exp: ranks placed by Ray: ranks 0-1 on 10.0.0.2" in echoed
    assert "a note of Ray's own" in (tmp_path / "driver.log").read_text()


def test_text_from_the_cluster_reaches_the_console_and_the_logs_without_terminal_escapes(tmp_path):
    lines = [
        message(kind="line", rank=0, line="step 1 \x1b]0;owned\x07\x1b[2J\x9b2J\tdone"),
        message(kind="note", note="placed \x1b[31mred"),
        message(kind="failure", rank=0, reason="gone \x1b[8mhidden"),
    ]
    echoed: list[str] = []
    with (
        FakeJobApi(log="\n".join(lines) + "\n", status="FAILED").running() as api,
        pytest.raises(RankFailure) as failed,
    ):
        placed_and_followed(api, tmp_path, echoed)
    said = [*echoed, (tmp_path / "0_log.out").read_text(), failed.value.reason]
    assert not any(c in text for text in said for c in "\x1b\x07\x9b"), said
    assert echoed[1:] == ["step 1 \\x1b]0;owned\\x07\\x1b[2J\\x9b2J\tdone", "titan_exp: placed \\x1b[31mred"]
    assert failed.value.reason == "gone \\x1b[8mhidden"


def test_a_failure_names_the_ranks_log_and_a_refusal_is_a_config_error(tmp_path):
    failure = message(kind="failure", rank=1, reason="ValueError: rank one gives up")
    with FakeJobApi(log=failure + "\n", status="FAILED").running() as api, pytest.raises(RankFailure) as failed:
        placed_and_followed(api, tmp_path)
    assert failed.value.rank == 1 and failed.value.log_path == tmp_path / "1_log.out"
    refusal = message(kind="refused", key="launcher.nodes", value="2", fix="ask for fewer nodes")
    with FakeJobApi(log=refusal + "\n", status="FAILED").running() as api, pytest.raises(ConfigError) as refused:
        placed_and_followed(api, tmp_path)
    assert str(refused.value) == "launcher.nodes=2: ask for fewer nodes"


def test_every_message_the_driver_says_reads_back_as_it_was(capsys):
    said = [
        *rank_lines(3, "z" * (RANK_LINE_PIECE_CHARS + 1)),
        Note("ranks placed"),
        Result({"metrics": {"loss": float("inf")}}),
        Failure(0, "lost its node 10.0.0.3"),
        Refusal("launcher.nodes", "2", "ask for fewer"),
        Unfinished("it ran past launcher.timeout_min", timed_out=True),
    ]
    for one in said:
        say(one)
    lines = capsys.readouterr().out.splitlines()
    assert all(line.startswith(MARKER) and len(line) <= MAX_LINE_CHARS for line in lines)
    assert [read_message(line[len(MARKER) :]) for line in lines] == said
    with pytest.raises(Unreadable):
        read_message('{"kind": "note", "note": "a", "and": "more"}')


def test_the_documented_runtime_env_form_reaches_the_submission_with_the_launchers_own_variables(tmp_path):
    section = compose_job_config([*RAY, "launcher.runtime_env={env_vars:{A:b},pip:[x]}"]).launcher
    assert section.runtime_env == {"env_vars": {"A": "b"}, "pip": ["x"]}
    with FakeJobApi(log=message(kind="result", result={}) + "\n").running() as api:
        assert placed_and_followed(api, tmp_path, runtime_env=section.runtime_env) == RankResult()
    [submitted] = api.submitted
    assert submitted["runtime_env"]["env_vars"] == {"RAY_JOB_STOP_WAIT_TIME_S": "35", "A": "b"}
    assert submitted["runtime_env"]["working_dir"].startswith("gcs://")


# launcher.runtime_env values Ray refuses only once the job is submitted: the key each refusal names.
BAD_RUNTIME_ENVS = {
    "+launcher.runtime_env.env_vars=3": "launcher.runtime_env.env_vars=3: Ray refuses it",
    "+launcher.runtime_env.env_vars.A=1": "launcher.runtime_env.env_vars={'A': 1}: Ray refuses it",
    "+launcher.runtime_env.pip=3": "launcher.runtime_env.pip=3: Ray refuses it",
    "+launcher.runtime_env.py_modules=[/no/such/folder]": "launcher.runtime_env.py_modules=['/no/such/folder']",
    "+launcher.runtime_env.bogus=1": "launcher.runtime_env.bogus=1: is not a field of Ray's runtime_env",
    "+launcher.runtime_env.working_dir=/code": "launcher.runtime_env.working_dir=/code: is the launcher's own",
    "launcher.runtime_env=3": "launcher.runtime_env=3: must be a table",
    "launcher.runtime_env={pip:[x],conda:env}": "launcher.runtime_env={'pip': ['x'], 'conda': 'env'}: Ray refuses",
}


@pytest.mark.parametrize("override", BAD_RUNTIME_ENVS)
def test_a_runtime_env_ray_would_refuse_is_refused_before_anything_is_written(override, tmp_path):
    with pytest.raises(ConfigError) as refused:
        resolve(compose_job_config([*RAY, override]), job_dir=tmp_path / "job")
    said = str(refused.value)
    assert said.startswith(BAD_RUNTIME_ENVS[override]) and len(said.splitlines()) == 1, said
    assert list(tmp_path.iterdir()) == []


def refusal_of(address: str) -> tuple[str | None, float]:
    section = compose_job_config([*RAY, f"launcher.address={address}"]).launcher
    spec = JobSpec("test", Placement("ray", "cpu", 2, 1, 1), 5, 60.0, resumable=False)
    started = time.monotonic()
    return RayLauncher(section).refusal(spec, Path("unused")), time.monotonic() - started


def test_a_ray_client_address_where_nothing_listens_is_refused_at_once_in_one_line():
    address = f"ray://127.0.0.1:{free_port()}"
    said, seconds = refusal_of(address)
    assert seconds < 3, seconds  # Ray Client itself tries for ~30 s
    assert said.startswith(f"no Ray cluster answers at launcher.address={address} (") and "refused" in said, said
    assert len(said.splitlines()) == 1


def test_an_answer_past_the_size_bound_fails_the_job_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_client, "MAX_ANSWER_BYTES", 4096)
    log = message(kind="line", rank=0, line="x" * 5000) + "\n"  # the whole log, read at the end, is too large
    with FakeJobApi(log=log).running() as api, pytest.raises(ray_client.AnswerTooLarge) as refused:
        placed_and_followed(api, tmp_path)
    assert "answered more than" in str(refused.value) and len(str(refused.value).splitlines()) == 1


def _rank_outcome(target: Entrypoint, arg: object) -> dict:
    """What a rank of `target(arg)` leaves for its actor, run as launcher=ray runs one (a process
    of its own, started and polled by RankProcess)."""
    rank = RankProcess()
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    rank.start(cloudpickle.dumps((target, arg)), env, os.getcwd())
    deadline = time.monotonic() + 60
    while (state := rank.poll())["exit"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    rank.stop(1.0)
    return state["outcome"]


def test_a_ranks_result_leaves_the_rank_as_json_data_and_a_dataclass_as_its_fields():
    outcome = _rank_outcome(Entrypoint("titan_exp.job.result:RankResult"), {"loss": 1.5})
    assert outcome == {"result": {"metrics": {"loss": 1.5}, "stopped": None, "tracking_incomplete": None}}
    assert RankResult.from_data(outcome["result"]) == RankResult({"loss": 1.5})
    refused = _rank_outcome(Entrypoint("builtins:set"), [1])  # a set is no JSON: the rank fails, saying so
    assert "Object of type set is not JSON serializable" in refused["error"]
