"""Real Slurm clusters for the tests: Debian's munged, slurmctld and slurmd, all state in one directory.

* :class:`LocalSlurm`: one 2-CPU node, ``localhost``, its daemons on loopback ports.
* :class:`TwoHostSlurm`: hosts ``h1`` and ``h2`` on this machine. Each host is a network, UTS
  and mount namespace with its own hostname, ``/etc/hosts`` and ``/dev/shm``; one veth pair
  joins them, with addresses that exist only inside the two namespaces. h1 runs slurmctld and a
  slurmd, h2 a slurmd; munged runs in a third namespace that has only loopback (clients reach
  it through its socket on the shared filesystem). ``/tmp`` is shared, like a cluster's shared
  filesystem. Nothing listens on the machine's real interfaces.

Both start their daemons in the foreground as children of the test, write their own key and
``slurm.conf`` under ``root``, and offer the client commands (``run``, ``sbatch``,
``wait_job``, ...). ``stop()`` is idempotent and removes everything started: jobs, daemons, ``root`` and, for
the two hosts, every process inside their namespaces and the namespaces themselves.
:func:`cluster` is the context manager the fixtures use: it stops the cluster also on a
failure, ``SIGTERM`` or interpreter exit, and :func:`sweep_stale_hosts` removes the namespaces
of a test process that was killed before it could clean up.
Root only (SlurmUser=root); :func:`missing` says why a cluster cannot run here.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gdpo_megatron.distributed.launch import free_port

REPO = Path(__file__).resolve().parents[2]
SBIN = "/usr/sbin:/sbin"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "scancel", "squeue", "srun")
NAMESPACE_TOOLS = ("ip", "nsenter", "unshare")
# A requeued job may start again once its credentials expire (default 120 s) and the next
# scheduling pass (sched_interval, default 60 s) sees it.
CRED_EXPIRE_S = 5
START_TIMEOUT_S = 30
JOB_TIMEOUT_S = 300
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED")
# Launcher variables a pytest process may carry from other tests; the jobs must not inherit them.
FOREIGN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=SBIN)


def missing(two_hosts: bool = False) -> str | None:
    """Why a cluster cannot run on this machine (a one-line skip reason), or None."""
    tools = DAEMONS + CLIENTS + (NAMESPACE_TOOLS if two_hosts else ())
    absent = [name for name in tools if which(name) is None]
    if absent:
        return f"Slurm / munge / iproute2 not installed ({', '.join(absent)} missing): apt-get install slurm-wlm munge iproute2"
    if os.geteuid() != 0:
        return "a local Slurm runs its daemons as root (SlurmUser=root)"
    if two_hosts:
        if not os.path.ismount("/sys/fs/cgroup"):
            return "slurmd needs /sys/fs/cgroup mounted"
        probe = f"gdpo-probe-{os.getpid()}"
        made = subprocess.run([which("ip"), "netns", "add", probe], capture_output=True, text=True)
        if made.returncode:
            return f"cannot create network namespaces here ({made.stderr.strip() or 'ip netns add failed'})"
        subprocess.run([which("ip"), "netns", "del", probe], capture_output=True)
    return None


def slurm_conf(root: Path, controller: str, settings: dict[str, object], nodes: list[str], partition: str) -> str:
    """A ``slurm.conf`` with every file under ``root``; ``settings`` add to or replace the common ones."""
    common = {
        "ClusterName": "gdpo-test",
        "SlurmctldHost": controller,
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        "AuthInfo": f"socket={root}/munge.socket,cred_expire={CRED_EXPIRE_S}",
        "StateSaveLocation": f"{root}/state",
        "SlurmdSpoolDir": f"{root}/spool/%n",  # %n: the node's name (slurmd does not create it)
        "SlurmctldPidFile": f"{root}/slurmctld.pid",
        "SlurmdPidFile": f"{root}/slurmd-%n.pid",
        "SlurmctldLogFile": f"{root}/slurmctld.log",
        "SlurmdLogFile": f"{root}/slurmd-%n.log",
        "MailProg": "/bin/true",
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/affinity",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "JobCompType": "jobcomp/none",
        "SchedulerType": "sched/builtin",
        "SchedulerParameters": "sched_interval=1",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_CPU",
        "MpiDefault": "none",
        "ReturnToService": 2,  # a node that was down is back as soon as its slurmd registers
        "KillWait": 10,
    }
    lines = [f"{key}={value}" for key, value in {**common, **settings}.items()]
    return "\n".join([*lines, *nodes, partition]) + "\n"


class SlurmCluster:
    """What both clusters share: the daemons' start and the client commands. Subclasses place
    the daemons (:meth:`command` says where a command runs) and write the configuration."""

    nodes: tuple[str, ...] = ()

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}  # by name, e.g. "slurmd-h2"
        self.stopped_daemons: set[str] = set()  # those a test stopped on purpose
        self.jobs: list[str] = []
        self._stopped = False
        self.env = {k: v for k, v in os.environ.items() if k not in FOREIGN_VARS and not k.startswith("SLURM_")}
        self.env.update(
            SLURM_CONF=str(self.conf),
            PATH=os.pathsep.join([str(Path(sys.executable).parent), self.env.get("PATH", ""), SBIN]),
            OMP_NUM_THREADS="1",
            WANDB_MODE="offline",
            # Tasks float over the node's CPUs (what srun reads as --cpu-bind) unless a job binds.
            SLURM_CPU_BIND="none",
        )

    # --- where commands run (subclasses) ------------------------------------------------------

    def command(self, argv: list[str], host: str | None = None) -> list[str]:
        """``argv`` as run on ``host`` (default: the controller's host)."""
        raise NotImplementedError

    def _configure(self) -> str:
        raise NotImplementedError

    def _teardown(self) -> None:
        raise NotImplementedError

    # --- bring-up and teardown ----------------------------------------------------------------

    def start(self) -> None:
        atexit.register(self.stop)
        self.root.chmod(0o755)  # munged's socket directory: everyone may traverse it
        for sub in ("state", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf.write_text(self._configure())
        socket_path = self.root / "munge.socket"
        self._spawn("munged", self._munged_command(
            [which("munged"), "-F", f"--key-file={key}", f"--socket={socket_path}",
             f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log",
             f"--seed-file={self.root}/munged.seed"]))
        self.wait_for(socket_path.exists, "munged to create its socket")
        self._spawn("slurmctld", self.command([which("slurmctld"), "-D", "-f", str(self.conf)]))
        self.wait_for(lambda: self.run("scontrol", "ping", check=False).returncode == 0, "slurmctld to answer")
        for node in self.nodes:
            self.start_slurmd(node)
        self.wait_for(lambda: self.node_states() == {n: "idle" for n in self.nodes}, "the nodes to become idle")

    def _munged_command(self, argv: list[str]) -> list[str]:
        return argv

    def start_slurmd(self, node: str) -> None:
        # An absolute -f path: with a relative one a step launch on the node hangs for 60 s.
        self.stopped_daemons.discard(f"slurmd-{node}")
        self._spawn(f"slurmd-{node}", self.command([which("slurmd"), "-D", "-N", node, "-f", str(self.conf)], node))

    def stop(self) -> None:
        """Remove everything started (idempotent). A second SIGTERM or Ctrl-C waits until it is done."""
        if self._stopped:
            return
        self._stopped = True
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            self._teardown()
            for proc in self.daemons.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
            shutil.rmtree(self.root, ignore_errors=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            atexit.unregister(self.stop)

    # --- client commands ----------------------------------------------------------------------

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """A client command, on the controller's host."""
        return subprocess.run(self.command([which(cmd[0]) or cmd[0], *cmd[1:]]), env=self.env, cwd=REPO,
                              capture_output=True, text=True, timeout=30, check=check)

    def sbatch(self, script: str, *args: str, options: tuple[str, ...] = ()) -> str:
        """Submit ``script`` (relative to the repository) with ``args`` and sbatch ``options``; return the job id."""
        out = self.run("sbatch", "--parsable", f"--output={self.root}/job-%j.out", *options, script, *args).stdout
        job = out.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job_info(self, job: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def state(self, job: str) -> str:
        return self.job_info(job).get("JobState", "UNKNOWN")

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_job(self, job: str, timeout_s: float = JOB_TIMEOUT_S) -> dict[str, str]:
        """Wait until ``job`` has ended; return its ``scontrol show job`` fields."""
        self.wait_for(lambda: self.state(job) in ENDED, f"job {job} to end", timeout_s)
        return self.job_info(job)

    def log(self, job: str) -> str:
        path = self.root / f"job-{job}.out"
        return path.read_text(errors="replace") if path.exists() else f"(no output file {path})"

    def daemon_logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted([*self.root.glob("*.log"), *self.root.glob("*.out")])
                         if not p.name.startswith("job-"))

    def wait_for(self, ready, what: str, timeout_s: float = START_TIMEOUT_S, interval_s: float = 0.5) -> None:
        """Poll ``ready()`` until true; raise if a daemon died or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [name for name, p in self.daemons.items() if p.poll() is not None and name not in self.stopped_daemons]
            if dead:
                raise RuntimeError(f"waiting for {what}: {', '.join(dead)} exited\n{self.daemon_logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s} s for {what}\n{self.daemon_logs()}")
            time.sleep(interval_s)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.root / f"{name}.out", "w") as out:
            proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.daemons[name] = proc
        return proc


class LocalSlurm(SlurmCluster):
    """munged + slurmctld + slurmd of one 2-CPU node ``localhost``, on free loopback ports."""

    nodes = ("localhost",)  # the node's name is also its address: the tasks rendezvous on it

    def command(self, argv: list[str], host: str | None = None) -> list[str]:
        return argv

    def _configure(self) -> str:
        node = self.nodes[0]
        return slurm_conf(self.root, node, {"SlurmctldPort": free_port(), "SlurmdPort": free_port()},
                          [f"NodeName={node} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN"],
                          f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP")

    def _teardown(self) -> None:
        """Cancel the jobs and wait for them (their processes are slurmd's), then stop the daemons."""
        if self.jobs and self.daemons and all(p.poll() is None for p in self.daemons.values()):
            self.run("scancel", "--full", *self.jobs, check=False)
            with contextlib.suppress(TimeoutError, RuntimeError):
                self.wait_for(lambda: all(self.state(job) in (*ENDED, "UNKNOWN") for job in self.jobs),
                              "the jobs to end")
        for proc in reversed(self.daemons.values()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.daemons.values()):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


NAMESPACE_PREFIX = "gdpo-2host-"


class TwoHostSlurm(SlurmCluster):
    """Hosts h1 (slurmctld, slurmd) and h2 (slurmd) as namespaces joined by a veth pair.

    ``settings`` add to or replace slurm.conf settings (e.g. ``SlurmdTimeout``).
    Faults: :meth:`kill_host` (every process of a host but its namespace holder), :meth:`link`.
    """

    nodes = ("h1", "h2")
    controller = "h1"

    def __init__(self, root: Path, settings: dict[str, object] | None = None, subnet: str = "10.24.0"):
        super().__init__(root)
        del self.env["SLURM_CPU_BIND"]  # task/none binds nothing (srun would warn about it)
        self.settings = settings or {}
        self.subnet = subnet
        self.address = {host: f"{subnet}.{i}" for i, host in enumerate(self.nodes, 1)}
        # Unique per cluster; a sweeper finds those of a dead test process by the pid.
        self.prefix = f"{NAMESPACE_PREFIX}{os.getpid()}-{root.name[-6:]}"
        self.namespaces = {name: f"{self.prefix}-{name}" for name in (*self.nodes, "ctl")}
        self.holders: dict[str, subprocess.Popen] = {}

    def command(self, argv: list[str], host: str | None = None) -> list[str]:
        """``argv`` inside ``host``'s namespaces (nsenter does not fork: the pid is the command's)."""
        holder = self.holders[host or self.controller].pid
        return [which("nsenter"), "-t", str(holder), "--net", "--uts", "--mount", f"--wd={REPO}", "--", *argv]

    def _munged_command(self, argv: list[str]) -> list[str]:
        return [which("nsenter"), f"--net=/run/netns/{self.namespaces['ctl']}", "--", *argv]

    def start(self) -> None:
        atexit.register(self.stop)  # from the first namespace on
        self._network()
        super().start()

    def _network(self) -> None:
        ip = which("ip")
        for namespace in self.namespaces.values():
            _check([ip, "netns", "add", namespace])
            _check([ip, "-n", namespace, "link", "set", "lo", "up"])
        h1, h2 = (self.namespaces[h] for h in self.nodes)
        _check([ip, "link", "add", "eth0", "netns", h1, "type", "veth", "peer", "name", "eth0", "netns", h2])
        for host in self.nodes:
            _check([ip, "-n", self.namespaces[host], "addr", "add", f"{self.address[host]}/24", "dev", "eth0"])
            _check([ip, "-n", self.namespaces[host], "link", "set", "eth0", "up"])
        # The ::ffff: lines let torch's dual-stack TCPStore name its IPv4 peers without DNS.
        hosts = self.root / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{a} {h}\n::ffff:{a} {h}\n" for h, a in self.address.items()))
        for host in self.nodes:
            # One long-lived process per host holds its UTS and mount namespaces: hostname, a private
            # /etc/hosts and /dev/shm. nsenter --net, not `ip netns exec`, which remounts /sys
            # without /sys/fs/cgroup (slurmd then fails to start).
            setup = (f"hostname {host} && mount --bind {hosts} /etc/hosts && "
                     "mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec sleep infinity")
            self.holders[host] = subprocess.Popen(
                [which("nsenter"), f"--net=/run/netns/{self.namespaces[host]}", "--", which("unshare"), "--uts",
                 "--mount", "--propagation", "private", "--", "sh", "-c", setup],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        for host, holder in self.holders.items():
            self.wait_for(lambda: _comm(holder.pid) == "sleep" or holder.poll() is not None, f"host {host}")
            if holder.poll() is not None:
                raise RuntimeError(f"host {host}: its namespace holder exited with {holder.returncode}")

    def _configure(self) -> str:
        settings = {
            "ClusterName": "gdpo-2host",
            # Both "hosts" share this machine's CPUs: no binding of tasks to cores.
            "TaskPlugin": "task/none",
            "KillWait": 5,  # a cancelled job's tasks get this long after SIGTERM (they ignore it)
            **self.settings,
        }
        nodes = [f"NodeName={h} NodeAddr={a} CPUs=2 RealMemory=1000 State=UNKNOWN" for h, a in self.address.items()]
        return slurm_conf(self.root, f"{self.controller}({self.address[self.controller]})", settings, nodes,
                          f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")

    # --- faults -------------------------------------------------------------------------------

    def pids(self, host: str) -> list[int]:
        """Every process in ``host``'s network namespace (its holder included)."""
        return _namespace_pids(self.namespaces[host])

    def processes(self, host: str, pattern: str) -> list[int]:
        """Processes of ``host`` whose command line (arguments joined by spaces) matches the regex ``pattern``."""
        return [pid for pid in self.pids(host) if re.search(pattern, _cmdline(pid))]

    def kill_host(self, host: str) -> None:
        """SIGKILL everything on ``host`` (slurmd, job steps, tasks) but its namespace holder: the
        host is gone and its kernel closes its connections, as when a machine's processes die."""
        holder = self.holders[host].pid
        self.stopped_daemons.add(f"slurmd-{host}")
        for pid in self.pids(host):
            if pid != holder:
                _kill(pid)

    def link_bytes(self, host: str) -> int:
        """Bytes ``host`` has sent and received over its link so far."""
        stats = Path(f"/proc/{self.holders[host].pid}/net/dev").read_text()
        fields = re.search(r"^\s*eth0:(.*)$", stats, re.MULTILINE).group(1).split()
        return int(fields[0]) + int(fields[8])  # receive bytes, transmit bytes

    def link(self, host: str, up: bool) -> None:
        """Take ``host``'s interface down (it stops answering without dying) or bring it back."""
        _check([which("ip"), "-n", self.namespaces[host], "link", "set", "eth0", "up" if up else "down"])

    # --- teardown -----------------------------------------------------------------------------

    def _teardown(self) -> None:
        """SIGKILL every process of the namespaces (the tasks ignore SIGTERM, and every state is
        deleted anyway), then delete the namespaces (with processes left, `ip netns del` would
        only remove the name) and the files."""
        _remove_namespaces(list(self.namespaces.values()))
        for proc in [*self.holders.values(), *self.daemons.values()]:
            if proc.poll() is None:
                _kill(proc.pid)


def _remove_namespaces(namespaces: list[str]) -> None:
    for _ in range(3):  # a dying slurmstepd may still fork
        pids = [pid for ns in namespaces for pid in _namespace_pids(ns)]
        if not pids:
            break
        for pid in pids:
            _kill(pid)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_namespace_pids(ns) for ns in namespaces):
            time.sleep(0.1)
    for namespace in namespaces:
        subprocess.run([which("ip"), "netns", "del", namespace], capture_output=True)


def sweep_stale_hosts() -> None:
    """Remove the namespaces of two-host clusters whose test process is gone (killed with SIGKILL)."""
    listed = subprocess.run([which("ip"), "netns", "list"], capture_output=True, text=True).stdout
    stale: dict[int, list[str]] = {}
    for name in re.findall(rf"^({re.escape(NAMESPACE_PREFIX)}(\d+)-\S+)", listed, re.MULTILINE):
        owner = int(name[1])
        if not Path(f"/proc/{owner}").exists():
            stale.setdefault(owner, []).append(name[0])
    for namespaces in stale.values():
        _remove_namespaces(namespaces)


@contextlib.contextmanager
def cluster(kind: type[SlurmCluster], **kwargs):
    """A started cluster of ``kind`` under a fresh directory, stopped and removed at the end, on
    a failure, on SIGTERM (a CI timeout) and at interpreter exit."""
    # Not under pytest's private (0700) temporary tree: munged needs a socket path that every
    # user may traverse.
    root = Path(tempfile.mkdtemp(prefix="gdpo-slurm-"))
    instance = kind(root, **kwargs)

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        instance.start()
        yield instance
    finally:
        instance.stop()
        signal.signal(signal.SIGTERM, previous)


def _check(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def _namespace_pids(namespace: str) -> list[int]:
    out = subprocess.run([which("ip"), "netns", "pids", namespace], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
