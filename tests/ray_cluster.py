"""A real local Ray cluster for tests: a head and N-1 more nodes on this host, started and stopped by the test.

    with ray_cluster(tmp_path, nodes=2) as cluster:
        cluster.address          # "127.0.0.1:PORT", for ray.init(address=…) or --ray
        cluster.node_ids()       # Ray node ids, head first (from each raylet's command line)
        cluster.kill_node(1)     # SIGKILL the second node's raylet (and what it started): a node lost mid-run

Every port is a free one (so two clusters can run side by side) and the Ray temp dir is the cluster's own short
directory (unix socket paths must stay under 108 bytes, so not under tmp_path). Teardown stops only the processes
whose command line names that directory, and their children (Ray renames its agents and workers, so they are found
by parent) — never ``ray stop``, never another cluster's processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 90.0
WORKER_PORTS = 40
"""Ports per node for Ray workers (actors, tasks); a test cluster runs a handful."""


def ray_available() -> bool:
    """Ray is an optional extra: its tests skip only when it is not installed in this venv."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return os.path.exists(RAY)


needs_ray = pytest.mark.skipif(not ray_available(), reason="ray is not installed (pip install kvcap[ray])")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now (held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_range(n: int) -> int:
    """The first of ``n`` consecutive ports that are all free now (for Ray's --min/max-worker-port)."""
    for _ in range(200):
        base = free_ports(1)[0]
        if base + n >= 65535:
            continue
        try:
            held = []
            for p in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def _with_descendants(roots: list[int]) -> list[int]:
    kids = _children()
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _kill(pids: list[int], grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL what lingers past ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 1.0)
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class RayCluster:
    """A started local cluster: its address, its nodes, and a way to lose one."""

    def __init__(self, temp_dir: Path, log_dir: Path, num_cpus: int) -> None:
        self.temp_dir, self.log_dir, self.num_cpus = temp_dir, log_dir, num_cpus
        self.port = 0
        self.node_manager_ports: list[int] = []
        self.taken: set[int] = set()
        """Ports given to any node of this cluster, worker ranges included: free now is not enough, since a node
        binds its worker ports only as it starts workers."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _ray_start(self, index: int, head: bool) -> None:
        base = free_port_range(WORKER_PORTS)
        while self.taken & set(range(base, base + WORKER_PORTS)):
            base = free_port_range(WORKER_PORTS)
        self.taken |= set(range(base, base + WORKER_PORTS))
        ports = free_ports(8)
        while self.taken & set(ports):  # free now, but another component's (a worker range binds late)
            ports = free_ports(8)
        self.taken |= set(ports)
        gcs, nm, om, agent, agent_grpc, rt_env, metrics, dash = ports
        args = [RAY, "start", "--node-ip-address", "127.0.0.1", "--temp-dir", str(self.temp_dir),
                "--num-cpus", str(self.num_cpus), "--node-manager-port", str(nm), "--object-manager-port", str(om),
                "--min-worker-port", str(base), "--max-worker-port", str(base + WORKER_PORTS - 1),
                "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
                "--runtime-env-agent-port", str(rt_env), "--metrics-export-port", str(metrics),
                "--object-store-memory", str(80 * 1024 * 1024), "--disable-usage-stats"]
        if head:
            self.port = gcs
            args += ["--head", "--port", str(gcs), "--include-dashboard=false", "--dashboard-port", str(dash)]
        else:
            args += ["--address", self.address]
        log = self.log_dir / f"ray-start-{index}.log"
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        with log.open("w") as f:
            proc = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, timeout=START_TIMEOUT_S, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start (node {index}) failed, exit {proc.returncode}:\n{log.read_text()[-3000:]}")
        self.node_manager_ports.append(nm)

    def pids(self) -> list[int]:
        """Every process of this cluster: those naming its temp dir, and their descendants."""
        mine = [int(d) for d in os.listdir("/proc") if d.isdigit() and str(self.temp_dir) in _cmdline(int(d))]
        return _with_descendants(mine)

    def _raylet(self, index: int) -> int | None:
        flag = f"--node_manager_port={self.node_manager_ports[index]}"
        for pid in self.pids():
            line = _cmdline(pid)
            if "/raylet/raylet" in line and flag in line.split():
                return pid
        return None

    def node_ids(self) -> list[str]:
        """Ray node ids (hex), in the order the nodes were started."""
        ids = []
        for i in range(len(self.node_manager_ports)):
            pid = self._raylet(i)
            line = _cmdline(pid) if pid else ""
            ids.extend(a.split("=", 1)[1] for a in line.split() if a.startswith("--node_id="))
        return ids

    def kill_node(self, index: int = 1) -> None:
        """SIGKILL node ``index``'s raylet and everything it started (its workers and agents): the node is lost."""
        if index == 0:
            raise ValueError("node 0 is the head; losing it loses the cluster")
        pid = self._raylet(index)
        if pid is None:
            raise RuntimeError(f"no raylet for node {index}")
        victims = _with_descendants([pid])
        for p in victims:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)

    def stop(self) -> None:
        _kill(self.pids())


@contextlib.contextmanager
def ray_cluster(tmp_path: Path, nodes: int = 2, num_cpus: int = 2) -> Iterator[RayCluster]:
    """Start ``nodes`` Ray nodes on 127.0.0.1 (logs under ``tmp_path``); stop only them at the end."""
    temp_dir = Path(tempfile.mkdtemp(prefix="kvray", dir="/tmp"))
    log_dir = Path(tmp_path)
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = RayCluster(temp_dir, log_dir, num_cpus)
    try:
        for i in range(nodes):
            cluster._ray_start(i, head=i == 0)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
