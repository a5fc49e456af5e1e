"""A Redis Cluster of the machine's own ``redis-server``: three masters, three replicas.

Every node runs on a free loopback port (its cluster bus on port + 10000) in a directory of its
own, without persistence; ``redis-cli --cluster create … --cluster-replicas 1`` joins them.
:meth:`RedisCluster.stop` ends each node by the PID it was started with, never by name, so a
cluster of another test run (or the shared Redis on 6379) is never touched.

Locally the fixtures skip when ``redis-server``/``redis-cli`` are missing; under ``CI=true``
they fail, like every other missing service.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import redis.cluster

from tests.conftest import CI, port_open

__all__ = ["ClusterNode", "RedisCluster", "require_cluster_tools", "start_cluster"]

NODE_TIMEOUT_MS = 2000
"""``cluster-node-timeout``: how long a silent master is given before its replica takes over."""


def require_cluster_tools() -> None:
    """Skip (locally) or fail (CI=true) when redis-server or redis-cli is not installed."""
    missing = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    if not missing:
        return
    message = f"a Redis Cluster needs {' and '.join(missing)} on PATH"
    if CI:
        pytest.fail(f"{message} (CI=true: a missing service is a failure, not a skip)")
    pytest.skip(message)


def _free_cluster_port(taken: set[int]) -> int:
    """A loopback port that is free, and whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port in taken or port + 10000 > 65535 or port + 10000 in taken:
            continue
        try:
            with socket.socket() as bus:
                bus.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports for a cluster node")


@dataclass
class ClusterNode:
    """One ``redis-server`` of the cluster, started by this process."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--logfile",
                "redis.log",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def info(self, section: str) -> dict[str, object]:
        client = self.client()
        try:
            return dict(client.info(section))
        finally:
            client.close()

    def cluster_info(self) -> dict[str, str]:
        client = self.client()
        try:
            reply = client.execute_command("CLUSTER INFO")
        finally:
            client.close()
        if isinstance(reply, dict):  # redis-py parses CLUSTER INFO into a dict
            return {str(k): str(v) for k, v in reply.items()}
        raw = reply.decode() if isinstance(reply, bytes) else str(reply)
        return dict(line.split(":", 1) for line in raw.split() if ":" in line)

    def kill(self) -> None:
        """SIGKILL: a crash, with whatever the replica had not received yet lost."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: the node neither answers nor replicates until :meth:`resume`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@dataclass
class RedisCluster:
    """Six nodes; :attr:`url` is the ``?cluster=true`` URL idemq's constructors take."""

    nodes: list[ClusterNode]
    root: Path
    _clients: list[redis.cluster.RedisCluster] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0?cluster=true"

    def client(self) -> redis.cluster.RedisCluster:
        """A cluster client (closed by :meth:`stop`)."""
        live = next(node for node in self.nodes if node.alive)
        client = redis.cluster.RedisCluster(host="127.0.0.1", port=live.port, socket_timeout=5)
        self._clients.append(client)
        return client

    def masters(self) -> list[ClusterNode]:
        """The live nodes that are masters now (a failover changes which they are)."""
        return [n for n in self.nodes if n.alive and n.info("replication")["role"] == "master"]

    def node_of(self, key: str) -> ClusterNode:
        """The live master that serves ``key``'s slot."""
        slot = redis.cluster.key_slot(key.encode())
        for node in self.masters():
            client = node.client()
            try:
                ranges = client.execute_command("CLUSTER SLOTS")
            finally:
                client.close()
            for start, end, master, *_ in ranges:
                if start <= slot <= end and int(master[1]) == node.port:
                    return node
        raise AssertionError(f"no live master serves slot {slot}")

    def replica_of(self, master: ClusterNode) -> ClusterNode:
        """The node replicating ``master`` now."""
        replication = master.info("replication")
        port = int(dict(replication["slave0"])["port"])  # type: ignore[call-overload]
        return next(node for node in self.nodes if node.port == port)

    def wait_ok(self, timeout_s: float = 60, *, replicas: bool = True) -> None:
        """Until every live node says ``cluster_state:ok`` and (``replicas``) every master has
        a replica in sync; after a failover the promoted master has none until one rejoins."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._ok(replicas):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"cluster not ok within {timeout_s} s (logs in {self.root})")
            time.sleep(0.1)

    def _ok(self, replicas: bool) -> bool:
        for node in self.nodes:
            if not node.alive:
                continue
            if node.cluster_info().get("cluster_state") != "ok":
                return False
            replication = node.info("replication")
            if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                return False
        masters = self.masters()
        if not replicas:
            return len(masters) == 3
        return len(masters) == 3 and all(m.info("replication")["connected_slaves"] for m in masters)

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def start_cluster() -> RedisCluster:
    """Start six nodes, join them as three masters with a replica each, wait until ok."""
    require_cluster_tools()
    root = Path(tempfile.mkdtemp(prefix="idemq-cluster-"))
    taken: set[int] = set()
    nodes: list[ClusterNode] = []
    for index in range(6):
        port = _free_cluster_port(taken)
        taken.update((port, port + 10000))
        nodes.append(ClusterNode(port, root / f"node{index}"))
    cluster = RedisCluster(nodes, root)
    try:
        for node in nodes:
            node.start()
        deadline = time.monotonic() + 20
        for node in nodes:
            while not port_open("127.0.0.1", node.port, 0.1):
                if not node.alive or time.monotonic() > deadline:
                    raise AssertionError(f"redis-server on {node.port} did not start ({root})")
                time.sleep(0.05)
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in nodes),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        cluster.wait_ok()
    except BaseException:
        cluster.stop()
        raise
    return cluster
