"""Multi-node for real: two network namespaces joined by a veth pair are two machines.

Each namespace has its own interfaces, addresses and ports, so the only way between the two
`ddpkit train` processes is the veth link, as between two hosts on a network; they share the
filesystem, as nodes with a shared --out do. Needs root and iproute2; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ddpkit_cli, logged_losses, primed_ddpkit
from run_scripts import HANG_SCRIPT, SLEEP_SCRIPT, listening

pytestmark = pytest.mark.slow

RUN = "toy --global-batch 12 --steps 12 --log-every 1 --seed 3"
# Seconds a `ddpkit train` may take to start and reach its rendezvous: about 3 on 2 quiet cores,
# ten times that at a load average of 20 on the shared machine.
STARTUP = 45
# One thread per process wherever runs are compared bit for bit: ddpkit gives a worker cores / local
# processes threads, so 2 processes on each of two machines and 4 on one get the same count only on
# a 2-core machine, and a float sum over 2 threads need not equal the sum over 1.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# The namespaces are new and empty, so nothing else can hold this port in them.
PORT = 29400
SUBNET = "10.123.0"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def machines():
    """Two namespaces `ns` with veth ends `iface` at SUBNET.1 and SUBNET.2; removed afterwards, always."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip command")
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    tag = os.getpid()
    hosts = [
        {"ns": f"ddpk{tag}{x}", "iface": f"vd{tag}{x}", "addr": f"{SUBNET}.{i + 1}"}
        for i, x in enumerate("ab")
    ]
    try:
        for host in hosts:
            made = _ip("netns", "add", host["ns"])
            if made.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
        steps = [("link", "add", hosts[0]["iface"], "type", "veth", "peer", "name", hosts[1]["iface"])]
        for host in hosts:
            steps += [
                ("link", "set", host["iface"], "netns", host["ns"]),
                ("-n", host["ns"], "addr", "add", f"{host['addr']}/24", "dev", host["iface"]),
                ("-n", host["ns"], "link", "set", "lo", "up"),
                ("-n", host["ns"], "link", "set", host["iface"], "up"),
            ]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield hosts
    finally:
        for host in hosts:
            for pid in _ip("netns", "pids", host["ns"]).stdout.split():
                os.kill(int(pid), signal.SIGKILL)  # only processes this test started live in there
            _ip("netns", "del", host["ns"])  # takes the veth pair with it


def _ddpkit(args: list[str], after: dict | None) -> list[str]:
    """`python -m ddpkit ARGS`; with ``after``, started at once but acting (imports done) only once
    node 0 listens on that host's PORT, so that node 0 is the one that hosts the rendezvous."""
    if after is None:
        return [sys.executable, "-m", "ddpkit", *args]
    return primed_ddpkit(after["addr"], PORT, STARTUP, *args)


def _node(
    host: dict, out, flags: str, run: str | list[str] = RUN, after: dict | None = None
) -> subprocess.Popen:
    """`ddpkit train` inside a namespace; gloo is told which interface is the network. ``run`` as a
    list keeps a path with a space whole."""
    run = run.split() if isinstance(run, str) else run
    train = _ddpkit(["train", *run, "--out", str(out), *flags.split()], after)
    env = {**os.environ, **ONE_THREAD, "GLOO_SOCKET_IFNAME": host["iface"]}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen(["ip", "netns", "exec", host["ns"], *train], env=env, **pipes)


def _finish(proc: subprocess.Popen, limit: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running after {limit} s:\n{err[-3000:]}")
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory):
    """The reference: the same run as 4 processes on one machine (no namespaces)."""
    out = tmp_path_factory.mktemp("one_machine")
    cmd = [sys.executable, "-m", "ddpkit", "train", *RUN.split(), "--nproc", "4", "--out", str(out)]
    done = ddpkit_cli(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, **ONE_THREAD})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_two_machines_of_two_equal_one_machine_of_four(machines, one_machine, tmp_path, backend):
    a, b = machines
    out = tmp_path / "two_nodes"
    if backend == "c10d":
        # The README's command, without --local-addr: each node advertises its address on the
        # route to the endpoint (the two namespaces share a host name, as containers do).
        # --node-rank 1 on b only keeps `ddpkit train` there from preparing the shared --out a
        # second time; c10d assigns the ranks itself.
        launch = f"--rdzv-backend c10d --rdzv-endpoint {a['addr']}:{PORT} --rdzv-id netns"
        flags = [launch, f"{launch} --node-rank 1"]
    else:
        launch = f"--master-addr {a['addr']} --master-port {PORT}"
        flags = [f"{launch} --node-rank 0", f"{launch} --node-rank 1"]
    first = _node(a, out, f"--nnodes 2 --nproc 2 {flags[0]}")
    second = _node(b, out, f"--nnodes 2 --nproc 2 {flags[1]}", after=a)
    for proc in (first, second):
        code, _, err = _finish(proc, 180)
        assert code == 0, err[-3000:]
    # Bit-equal, no tolerance: rank r gets the same samples in both runs and gloo's allreduce over
    # 4 ranks runs the same algorithm whether or not a machine boundary lies between the ranks,
    # so every sum is taken in the same order.
    multi, single = (torch.load(p / "model.pt", weights_only=True) for p in (out, one_machine))
    assert all(torch.equal(multi[k], single[k]) for k in single)
    assert logged_losses(out) == logged_losses(one_machine)


TASK = Path(__file__).parents[2] / "examples" / "task_mlp.py"


def test_a_task_file_on_two_machines_equals_one_machine(machines, tmp_path):
    """Each node loads the user's task file itself; the ranks check they run the same job."""
    a, b = machines
    # A list, not a string split at spaces: the checkout's path may hold one.
    task = [str(TASK), *"--global-batch 32 --steps 8 --eval-every 4 --log-every 1 --seed 5".split()]
    reference = tmp_path / "one_machine"
    cmd = [sys.executable, "-m", "ddpkit", "train", *task, "--nproc", "2", "--out", str(reference)]
    done = ddpkit_cli(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, **ONE_THREAD})
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "two_nodes"
    launch = f"--nnodes 2 --nproc 1 --master-addr {a['addr']} --master-port {PORT}"
    first = _node(a, out, f"{launch} --node-rank 0", run=task)
    second = _node(b, out, f"{launch} --node-rank 1", run=task, after=a)
    outputs = []
    for proc in (first, second):
        code, stdout, err = _finish(proc, 180)
        assert code == 0, err[-3000:]
        outputs.append(stdout)
    assert "task_mlp trained to step 8 on 2 processes" in outputs[0]  # node 0 holds rank 0
    multi, single = (torch.load(p / "model.pt", weights_only=True) for p in (out, reference))
    assert all(torch.equal(multi[k], single[k]) for k in single)
    assert logged_losses(out) == logged_losses(reference)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert sum("eval_loss" in json.loads(line) for line in lines) == 2  # steps 4 and 8, both machines


def test_unreachable_master_on_the_network(machines, tmp_path):
    _, b = machines
    # Nobody has this address on the link: connects fail (no ARP answer) until the timeout.
    static = f"--nnodes 2 --node-rank 1 --nproc 1 --master-addr {SUBNET}.9 --master-port {PORT}"
    code, _, err = _finish(_node(b, tmp_path / "out", f"{static} --rdzv-conf timeout=3"), 3 + STARTUP)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert f"nothing answered at --master-addr/--master-port {SUBNET}.9:{PORT} within 3 s" in lines[0]


def test_a_node_zero_on_the_wrong_machine(machines, tmp_path):
    a, b = machines
    static = f"--nnodes 2 --node-rank 0 --nproc 1 --master-addr {a['addr']} --master-port {PORT}"
    real = _node(a, tmp_path / "a", f"{static} --rdzv-conf timeout=5")
    try:
        # The duplicate comes the moment the real node 0 listens, well within its 5 s timeout.
        duplicate = _node(b, tmp_path / "b", f"{static} --rdzv-conf timeout=5", after=a)
        code, _, err = _finish(duplicate, STARTUP + 10)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err[-3000:]
        assert f"another node already hosts the rendezvous at {a['addr']}:{PORT} as --node-rank 0" in lines[0]
    finally:
        code, _, err = _finish(real, 5 + STARTUP)
    # The real node 0 then waits out its 5 s for node 1, which never came, and says so.
    assert code == 2 and f"--node-rank 1 did not join the rendezvous at {a['addr']}:{PORT} within 5 s" in err


def _run_node(
    host: dict, flags: str, script: Path, *args: str, after: dict | None = None
) -> subprocess.Popen:
    """`ddpkit run` inside a namespace (`ip netns exec` execs it: the pid is the launcher's); its
    run folder (and any report) goes beside the script."""
    run = _ddpkit(["run", *flags.split(), str(script), *args], after)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": host["iface"], "TMPDIR": str(script.parent)}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen(["ip", "netns", "exec", host["ns"], *run], env=env, **pipes)


def test_multi_node_stores_listen_on_the_nodes_addresses_only(machines, tmp_path):
    a, b = machines
    script, ready = tmp_path / "sleep.py", tmp_path / "ready"
    script.write_text(SLEEP_SCRIPT)
    launch = f"--nnodes 2 --nproc 1 --rdzv-backend c10d --rdzv-endpoint {a['addr']}:{PORT} --rdzv-id bind"
    nodes = [_run_node(a, launch, script, str(ready))]  # no --local-addr: the route's address
    try:
        nodes.append(_run_node(b, launch, script, str(ready), after=a))
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, "no workers"
            time.sleep(0.05)
        on_a, on_b = listening(nodes[0].pid, a["ns"]), listening(nodes[1].pid, b["ns"])
    finally:
        for node in nodes:
            node.send_signal(signal.SIGTERM)
            node.communicate(timeout=60)
    # a hosts the rendezvous; the node c10d made rank 0 also hosts the workers' store.
    assert f"{a['addr']}:{PORT}" in on_a and len(on_a) + len(on_b) == 2, (on_a, on_b)
    for host, addresses in ((a, on_a), (b, on_b)):
        assert all(x.startswith(f"{host['addr']}:") for x in addresses), addresses


def test_a_hang_across_machines_is_reported_with_the_remote_ranks_stack(machines, tmp_path):
    a, b = machines
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT)  # rank 1, on b, never reaches the all-reduce of step 5
    launch = f"--nnodes 2 --nproc 1 --master-addr {a['addr']} --master-port {PORT} --collective-timeout 3"
    args = (script, str(tmp_path / "ready"))
    nodes = [_run_node(a, f"{launch} --node-rank 0", *args)]
    nodes.append(_run_node(b, f"{launch} --node-rank 1", *args, after=a))
    (code_a, _, err_a), (code_b, _, err_b) = (_finish(node, 120) for node in nodes)
    last_a, last_b = err_a.strip().splitlines()[-1], err_b.strip().splitlines()[-1]
    assert code_a == code_b == 1, err_a[-3000:]
    assert "rank 0 waited" in last_a and "rank 1 has not reached it" in last_a, err_a[-3000:]
    assert last_b == last_a  # node b names the same hang, from node 0's verdict
    report = Path(last_a.rsplit(" is in ", 1)[1]).read_text()
    assert "in stuck_forever" in report.split("stacks of rank 1")[1], report  # fetched from b


def test_a_node_that_cannot_reach_node_zeros_store_says_so_in_one_line(machines, tmp_path):
    a, b = machines
    script, ready = tmp_path / "sleep.py", tmp_path / "ready"
    script.write_text(SLEEP_SCRIPT)
    # Both advertise loopback, which only they themselves reach; whichever c10d makes node 0, the
    # other cannot connect to its workers' store and ends after read_timeout.
    conf = "--rdzv-conf bind_addr=0.0.0.0,read_timeout=3 --local-addr 127.0.0.1"
    launch = (
        f"--nnodes 2 --nproc 1 --rdzv-backend c10d --rdzv-endpoint {a['addr']}:{PORT} --rdzv-id far {conf}"
    )
    nodes = [_run_node(a, launch, script, str(ready))]
    try:
        nodes.append(_run_node(b, launch, script, str(ready), after=a))
        deadline = time.monotonic() + STARTUP + 60  # node 0's start-up included
        while any(n.poll() is None for n in nodes):
            assert time.monotonic() < deadline, "the nodes did not give up on each other's store"
            time.sleep(0.1)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
        ended = [node.communicate(timeout=60) for node in nodes]
    # Both end with one line (after torch's C++ warnings): the node that gave up says why, and node
    # 0, whose agent timed out waiting for it, repeats that reason instead of torch's timeout.
    last = [err.strip().splitlines()[-1] for _, err in ended]
    assert [node.returncode for node in nodes] == [2, 2], [err[-3000:] for _, err in ended]
    assert last[0] == last[1], last
    assert "cannot reach the workers' store at 127.0.0.1:" in last[0], last
    assert "node 0 advertised (Connection refused, for 3 s); start node 0 with --local-addr" in last[0]
