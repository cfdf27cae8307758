"""Where the ranks of a job meet. A Slurm job's: the first node of its node list (which Slurm
compresses, e.g. `gpu-[017-018],cpu1`) and a port derived from the job id, so that every task agrees
without talking first. The batch script runs `python -m launchers.rendezvous` on the job's first node
(the batch host) before srun starts the ranks: it prints the first port from the derived one that is
free there, which srun hands to every task as MASTER_PORT. Local and Ray jobs (and the tests'
servers) take a free port from the same range (`free_port`)."""

import itertools
import os
import random
import re
import socket

# Derived ports lie in [PORT_BASE, PORT_BASE + PORT_SPAN): above the well-known ones, below Linux's
# ephemeral range (32768-60999 by default), where a client's port could take ours.
PORT_BASE = 20000
PORT_SPAN = 10000
# How many ports are tried, PORT_TRIES apart from the derived one on: jobs whose ids differ by less
# than PORT_TRIES never try the same port (which ports after the derived one would).
PORT_TRIES = 64

# One element of a node list: a prefix and a bracketed range list, repeated (`a[1-2]-b[3-4]`),
# then a suffix; elements are separated by commas outside brackets.
_ELEMENT = re.compile(r"(?:[^,\[\]]*\[[^\]]*\])*[^,\[\]]*")


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list in full, in Slurm's order (`scontrol show hostnames`):
    'node[01-03,07],gpu1' -> node01, node02, node03, node07, gpu1. Zero padding is kept."""
    hosts: list[str] = []
    position = 0
    while position < len(nodelist):
        element = _ELEMENT.match(nodelist, position)
        if not element.group() or nodelist[element.end() : element.end() + 1] not in ("", ","):
            raise ValueError(f"not a Slurm node list: {nodelist!r}")
        hosts += _expand_element(element.group())
        position = element.end() + 1  # past the comma
    return hosts


def _expand_element(element: str) -> list[str]:
    """'a[1-2]-b[3-4]' -> a1-b3, a1-b4, a2-b3, a2-b4 (the first bracket varies slowest)."""
    head, bracket, tail = element.partition("[")
    if not bracket:
        return [element]
    ranges, _, rest = tail.partition("]")
    return [head + value + expanded for value in _range_values(ranges, element) for expanded in _expand_element(rest)]


def _range_values(ranges: str, element: str) -> list[str]:
    values = []
    for part in ranges.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"not a Slurm node list element: {element!r}")
        width = len(low)
        values += [str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]
    return values


def first_node() -> str:
    """The first node of this step (or job): where rank 0 runs under Slurm's block distribution."""
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ["SLURM_JOB_NODELIST"]
    return expand_nodelist(nodelist)[0]


def job_port(job_id: int) -> int:
    """The port every task of job `job_id` derives alone; jobs whose ids differ by less than
    PORT_SPAN get different ones."""
    return PORT_BASE + job_id % PORT_SPAN


def free_job_port(job_id: int) -> int:
    """The derived port if it is free on this host, else the first free one of those PORT_TRIES
    apart from it."""
    tried = [job_port(job_id + k * PORT_TRIES) for k in range(PORT_TRIES)]
    for port in tried:
        if _free(port):
            return port
    raise RuntimeError(f"ports {', '.join(map(str, tried))} are all in use on this host")


def free_port() -> int:
    """A port free on this host now, for a rendezvous this process starts (local ranks, Ray's
    rank 0, a test's servers). It lies below the ephemeral range, as a job's port does: a port the
    kernel hands out for port 0 lies inside it, where any outgoing connection on the host may take
    it before rank 0's store binds it again (a store then fails with EADDRINUSE). Each call starts
    from the next of a random sequence, so processes and successive calls seldom try the same port."""
    return free_job_port(next(_free_port_seeds))


def _new_free_port_seeds() -> None:
    global _free_port_seeds
    _free_port_seeds = itertools.count(random.randrange(PORT_SPAN))


_new_free_port_seeds()
# A forked process steps from a start of its own (random reseeds itself in the child first).
os.register_at_fork(after_in_child=_new_free_port_seeds)


def _free(port: int) -> bool:
    """Whether a listener could bind `port` on every address of this host (as torch's store does)."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


if __name__ == "__main__":
    print(free_job_port(int(os.environ["SLURM_JOB_ID"])))
