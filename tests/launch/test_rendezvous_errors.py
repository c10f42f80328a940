"""Bad multi-node input fails within the rendezvous timeout with one line on stderr, never a hang.

Every node runs as its own `ddpkit train` process on this machine; the rendezvous timeouts are set
short with --rdzv-conf, and each command must end before that timeout plus the time a process
takes to start. Torch's own waits, which a hang would run into, are longer than both together.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import primed_ddpkit

from ddpkit.cli import main
from ddpkit.launch.ports import free_port

TOY = "toy --global-batch 12 --steps 2 --nproc 1"
# Seconds a `ddpkit train` process may take to reach its rendezvous: about 3 on 2 quiet cores, but
# importing torch alone took 39 s at load average 23 on the shared 2-core machine. Still below
# torch's 60 s read_timeout, the wait an unresolvable address would otherwise hang in.
STARTUP = 45.0
# The static rendezvous timeout of the tests whose nodes must fail at once: far above STARTUP, so
# that ending within STARTUP + 10 s shows they did not wait it out.
LONG = 180


class Node:
    """One `ddpkit train` process playing a node, timed from its start."""

    def __init__(self, out, flags: str, after: int | None = None) -> None:
        """``after``: start now, but act (imports done) once node 0 listens on that port."""
        train = ["train", *TOY.split(), "--out", str(out), *flags.split()]
        cmd = [sys.executable, "-m", "ddpkit", *train]
        if after is not None:
            cmd = primed_ddpkit("127.0.0.1", after, STARTUP, *train)
        self.start = time.monotonic()
        pipes = {
            "stdout": subprocess.PIPE,
            "stderr": subprocess.PIPE,
            "text": True,
            "start_new_session": True,
        }
        self.proc = subprocess.Popen(cmd, **pipes)

    def finish(self, limit: float) -> tuple[int, str, float]:
        """Exit code, stderr and seconds taken; the process is killed if it runs past ``limit``."""
        try:
            _, err = self.proc.communicate(timeout=max(0.1, limit - (time.monotonic() - self.start)))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            _, err = self.proc.communicate()
            pytest.fail(f"still running after {limit:.0f} s: a hang, not an error\n{err[-2000:]}")
        return self.proc.returncode, err, time.monotonic() - self.start

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.communicate()


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpkit: error: "), f"not one error line:\n{err[-3000:]}"
    return lines[0]


@pytest.fixture
def nodes():
    """Nodes a test starts; any still running at the end are killed, even when the test fails."""
    started: list[Node] = []
    yield started
    for node in started:
        node.kill()


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        "--master-addr 127.0.0.1 --master-port {port} --node-rank 1 --rdzv-conf timeout=3",
        "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-conf is_host=0,read_timeout=3",
    ],
    ids=["static", "c10d"],
)
def test_unreachable_endpoint_is_one_line_after_the_timeout(tmp_path, nodes, flags):
    port = free_port()  # nothing listens there: every connect is refused
    nodes.append(Node(tmp_path / "out", "--nnodes 2 " + flags.format(port=port)))
    code, err, _ = nodes[0].finish(3 + STARTUP)
    line = one_line(err)
    assert code == 2
    assert "nothing answered at" in line and f"127.0.0.1:{port} within 3 s" in line, line
    assert "timeout=SECONDS" in line  # the fix: start the host, check the address, or wait longer


@pytest.mark.slow
def test_an_unresolvable_address_fails_at_once(tmp_path, nodes):
    endpoint = "no-such-node.invalid:29400"
    nodes.append(Node(tmp_path / "out", f"--nnodes 2 --rdzv-backend c10d --rdzv-endpoint {endpoint}"))
    code, err, _ = nodes[0].finish(STARTUP)  # well below torch's 60 s read_timeout
    assert code == 2
    assert "--rdzv-endpoint 'no-such-node.invalid' does not resolve" in one_line(err)


@pytest.mark.slow
def test_static_nodes_with_different_nnodes_both_fail(tmp_path, nodes):
    port = free_port()
    static = f"--master-addr 127.0.0.1 --master-port {port} --rdzv-conf timeout={LONG}"
    nodes.append(Node(tmp_path / "n0", f"--nnodes 3 --node-rank 0 {static}"))
    nodes.append(Node(tmp_path / "n1", f"--nnodes 2 --node-rank 1 {static}", after=port))
    for node in nodes:
        code, err, _ = node.finish(STARTUP + 10)  # far below the rendezvous timeout
        line = one_line(err)
        assert code == 2
        assert "nodes disagree on --nnodes:" in line, line
        assert "has --nnodes 3," in line and "has --nnodes 2;" in line, line
        assert "start every node with the same --nnodes" in line


@pytest.mark.slow
def test_c10d_node_with_other_nnodes_is_turned_away(tmp_path, nodes):
    port = free_port()
    c10d = f"--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-id job --rdzv-conf join_timeout=5"
    nodes.append(Node(tmp_path / "n0", f"--nnodes 2 {c10d}"))
    # Node 1 comes the moment node 0 listens, well within node 0's join_timeout.
    nodes.append(Node(tmp_path / "n1", f"--nnodes 3 {c10d}", after=port))
    code, err, _ = nodes[1].finish(STARTUP + 10)
    assert code == 2
    assert "has --nnodes 2," in one_line(err) and "has --nnodes 3;" in one_line(err)
    # The first node keeps waiting for valid peers (an elastic job must survive a stray node)
    # until its join_timeout, then says why nobody came.
    code, err, _ = nodes[0].finish(5 + STARTUP)
    line = one_line(err)
    assert code == 2
    assert f"the rendezvous at 127.0.0.1:{port} did not complete within join_timeout 5 s" in line, line
    assert "one was turned away: nodes disagree on --nnodes" in line


@pytest.mark.slow
def test_two_nodes_with_the_same_node_rank_all_fail(tmp_path, nodes):
    port = free_port()
    static = f"--nnodes 3 --master-addr 127.0.0.1 --master-port {port} --rdzv-conf timeout={LONG}"
    nodes.append(Node(tmp_path / "n0", f"--node-rank 0 {static}"))
    nodes += [Node(tmp_path / f"n{i}", f"--node-rank 1 {static}", after=port) for i in (1, 2)]
    for node in nodes:
        code, err, _ = node.finish(STARTUP + 10)  # far below the rendezvous timeout
        line = one_line(err)
        assert code == 2
        assert "two nodes have --node-rank 1:" in line, line
        assert "give each node its own --node-rank, 0 to 2" in line, line


@pytest.mark.slow
def test_a_second_node_zero_and_a_missing_node(tmp_path, nodes):
    port = free_port()
    static = f"--nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --master-port {port} --rdzv-conf timeout=4"
    nodes.append(Node(tmp_path / "n0", static))
    # The second node 0 comes the moment the first listens, well within its 4 s timeout.
    nodes.append(Node(tmp_path / "n1", static, after=port))
    code, err, _ = nodes[1].finish(STARTUP + 10)
    assert code == 2
    assert f"--master-port {port} is already in use on this machine: another node started here" in one_line(
        err
    )
    # Node 1 never comes: node 0 names it once its 4 s rendezvous timeout has passed.
    code, err, _ = nodes[0].finish(4 + STARTUP)
    assert code == 2
    assert f"--node-rank 1 did not join the rendezvous at 127.0.0.1:{port} within 4 s" in one_line(err)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            "--nnodes 1:2",
            "--nnodes 1:2 needs --rdzv-backend c10d: a static rendezvous has a fixed node count",
        ),
        ("--nnodes 2 --node-rank 2", "--node-rank 2 is outside 0 to 1 for --nnodes 2"),
    ],
)
def test_static_flags_that_cannot_work_are_refused_before_starting(tmp_path, capsys, flags, message):
    assert main(["train", *TOY.split(), "--out", str(tmp_path / "out"), *flags.split()]) == 2
    assert message in one_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
