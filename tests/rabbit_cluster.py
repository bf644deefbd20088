"""A real three-node RabbitMQ cluster on this machine, for the high-availability tests (issue 16).

Each node is a ``rabbitmq-server -detached`` of its own (node name, AMQP and
distribution ports, data and log directories) next to the machine's usual
broker, sharing its Erlang cookie and epmd. Nodes two and three join the
first. Each runs the management plugin on its own port (``management_url``
lists them all): workers find sub-queues through it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

import amqp

AMQP_PORTS = (5681, 5682, 5683)


@dataclass(frozen=True)
class Node:
    name: str
    port: int
    base: str

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.port + 20000),
            "RABBITMQ_MNESIA_BASE": f"{self.base}/mnesia",
            "RABBITMQ_LOG_BASE": f"{self.base}/log",
            "RABBITMQ_PID_FILE": f"{self.base}/pid",
            "RABBITMQ_ENABLED_PLUGINS_FILE": f"{self.base}/enabled_plugins",
            "RABBITMQ_CONFIG_FILE": f"{self.base}/rabbitmq",
        }

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def management_port(self) -> int:
        return self.port + 10000


def ctl(node: Node, *args: str, timeout: float = 60) -> str:
    done = subprocess.run(
        ["rabbitmqctl", "-n", node.name, *args], env=node.env(), capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl -n {node.name} {' '.join(args)}: {done.stderr or done.stdout}")
    return done.stdout


def await_node(node: Node, timeout: float = 120) -> None:
    """Until the node is booted: ``await_startup`` fails at once for a node epmd does not know yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ctl(node, "await_startup", "--timeout", str(int(timeout)), timeout=timeout + 10)
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class RabbitCluster:
    def __init__(self, ports: tuple[int, ...] = AMQP_PORTS) -> None:
        if shutil.which("rabbitmq-server") is None:
            raise RuntimeError("rabbitmq-server is not installed")
        # rabbitmq-server re-executes as the rabbitmq user: its directories must be that user's.
        self.base = tempfile.mkdtemp(prefix="prio-rabbit-cluster-", dir="/tmp")
        self.nodes = [Node(f"prio-ha{i}@localhost", port, f"{self.base}/n{i}") for i, port in enumerate(ports, 1)]
        user = pwd.getpwnam("rabbitmq")
        for node in self.nodes:
            os.makedirs(f"{node.base}/log")
            with open(f"{node.base}/enabled_plugins", "w") as f:
                f.write("[rabbitmq_management].\n")
            with open(f"{node.base}/rabbitmq.conf", "w") as f:
                # Quorum queues refuse new work below their free-disk limit; this box's disk varies.
                f.write(
                    "disk_free_limit.absolute = 10MB\n"
                    f"management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {node.management_port}\n"
                )
        for root, dirs, files in os.walk(self.base):
            for entry in [root, *(os.path.join(root, n) for n in dirs + files)]:
                os.chown(entry, user.pw_uid, user.pw_gid)

    @property
    def management_url(self) -> str:
        return ";".join(f"http://guest:guest@127.0.0.1:{node.management_port}" for node in self.nodes)

    @property
    def urls(self) -> str:
        """kombu's failover form: every node, tried in turn."""
        return ";".join(node.url for node in self.nodes)

    def start(self) -> None:
        self._stop_leftovers()
        for node in self.nodes:
            self.start_node(node, wait=False)
        for node in self.nodes:
            await_node(node)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            ctl(node, "stop_app")
            ctl(node, "reset")
            ctl(node, "join_cluster", first.name)
            ctl(node, "start_app")
        for node in self.nodes:
            await_node(node)

    def _stop_leftovers(self) -> None:
        """Nodes of these names left by a run that was killed hold the ports: stop them first."""
        names = subprocess.run(["epmd", "-names"], capture_output=True, text=True, check=False).stdout
        for node in self.nodes:
            if f"name {node.name.split('@')[0]} " in names:
                stop = ["rabbitmqctl", "-n", node.name, "stop"]
                subprocess.run(stop, env=node.env(), capture_output=True, check=False)

    def start_node(self, node: Node, wait: bool = True) -> None:
        subprocess.run(["rabbitmq-server", "-detached"], env=node.env(), check=True, timeout=60)
        if wait:
            await_node(node)

    def stop_node(self, node: Node) -> None:
        ctl(node, "stop", timeout=120)

    def running(self) -> list[str]:
        for node in self.nodes:
            try:
                out = ctl(node, "eval", "rabbit_nodes:all_running().", timeout=20)
                return [n.strip(" '[]\n") for n in out.split(",") if n.strip(" '[]\n")]
            except Exception:
                continue
        return []

    def leader(self, queue: str) -> Node:
        """The node that leads quorum queue ``queue`` now."""
        for node in self.nodes:
            try:
                out = ctl(node, "list_queues", "-q", "--no-table-headers", "name", "leader", timeout=30)
            except Exception:
                continue
            for line in out.splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0] == queue:
                    return next(n for n in self.nodes if n.name == parts[1])
        raise RuntimeError(f"no node reports a leader for {queue}")

    def connect(self, node: Node) -> amqp.Connection:
        conn = amqp.Connection(f"127.0.0.1:{node.port}", userid="guest", password="guest")
        conn.connect()
        return conn

    def close(self) -> None:
        """Every node stopped at once (nothing here is kept), then its files removed."""
        stops = [
            subprocess.Popen(
                ["rabbitmqctl", "-n", n.name, "stop"], env=n.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            for n in self.nodes
        ]
        for node, stop in zip(self.nodes, stops, strict=True):
            try:
                stop.wait(60)
            except subprocess.TimeoutExpired:
                stop.kill()
            pid = _read(f"{node.base}/pid")
            if pid and os.path.exists(f"/proc/{pid}"):
                subprocess.run(["kill", "-9", pid], check=False)
        shutil.rmtree(self.base, ignore_errors=True)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


if __name__ == "__main__":  # python -m tests.rabbit_cluster: start, show, stop (how long it takes)
    t0 = time.monotonic()
    cluster = RabbitCluster()
    try:
        cluster.start()
        print(f"cluster up in {time.monotonic() - t0:.1f} s: {cluster.running()}")
    finally:
        t1 = time.monotonic()
        cluster.close()
        print(f"stopped in {time.monotonic() - t1:.1f} s")
