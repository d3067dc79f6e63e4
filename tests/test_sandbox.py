"""The code sandbox contains each escape attempt, and none of them hangs the caller.

One test per attack class. A test of a property the active level does not guarantee (see
``sandbox.isolation()``) is skipped; with bubblewrap installed none is.
"""
import ctypes
import os
import random
import signal
import socket
import time

import pytest

from gdpo_megatron.rewards import sandbox
from gdpo_megatron.rewards.sandbox import SandboxError, SandboxLimits, run_python

# Generous wall time: a loaded 2-core machine can take seconds to start an interpreter.
LIMITS = SandboxLimits(wall_s=10.0, cpu_s=1, memory_bytes=256 << 20, output_bytes=64 << 10, processes=16)
# For programs that end by a timeout anyway.
SHORT = SandboxLimits(wall_s=1.0, cpu_s=1, memory_bytes=256 << 20, output_bytes=64 << 10, processes=16)


def guaranteed(key):
    assert key in dict(sandbox.GUARANTEES)
    return pytest.mark.skipif(not sandbox.isolation().guarantees[key],
                              reason=f"level {sandbox.isolation().level!r} does not guarantee {key}")


def marker():
    """A word to find the program's processes by on the host (in their command lines)."""
    return f"gdpo-test-marker-{os.getpid()}-{random.randrange(1 << 30)}"


def processes_with(word):
    """Host processes (not zombies) whose command line contains ``word``."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if word.encode() in f.read() and _state(entry.name) != "Z":
                        found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


def zombie_children():
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and _parent_and_state(e.name) == (os.getpid(), "Z")]


def _parent_and_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(fields[1]), fields[0]


def _state(pid):
    found = _parent_and_state(pid)
    return found[1] if found else "gone"


def sleeper(word):
    """Program text that replaces the current process by a Python sleeping 1000 s, named ``word``."""
    return f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(1000)', {word!r}])"


def test_isolation_is_reported_per_guarantee():
    report = sandbox.isolation()
    assert report.level in sandbox.ISOLATION_LEVELS
    assert set(report.guarantees) == {key for key, _ in sandbox.GUARANTEES}
    assert all(isinstance(v, bool) for v in report.guarantees.values())
    text = str(report)
    assert report.level in text and all(description in text for _, description in sandbox.GUARANTEES)
    if report.level == "basic":
        assert not report.guarantees["no_network"] and not report.guarantees["writes_confined"]


@pytest.fixture
def fresh_probe():
    """The isolation probe runs again in the test, and again after it."""
    sandbox.isolation.cache_clear()
    sandbox._bwrap_failure.cache_clear()
    yield
    sandbox.isolation.cache_clear()
    sandbox._bwrap_failure.cache_clear()


def test_falling_back_to_the_basic_level_says_why(fresh_probe, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with caplog.at_level("WARNING", logger="gdpo_megatron.rewards.sandbox"):
        assert sandbox.isolation().level == "basic"
    assert any("'basic'" in r.getMessage() and "bwrap" in r.getMessage() and "not installed" in r.getMessage()
               for r in caplog.records), caplog.text


def test_runs_a_program_with_stdin_and_leaves_no_directory(tmp_path):
    before = set(os.listdir(tmp_path.parent.parent))
    code = "import os\nprint(input()[::-1])\nprint(sorted(os.listdir('.')))\nopen('f', 'w').write('x')"
    result = run_python(code, "abc\n", LIMITS)
    assert result.ok and result.returncode == 0
    assert result.stdout.splitlines() == ["cba", "['main.py']"]
    assert run_python(code, "xy\n", LIMITS).stdout.splitlines() == ["yx", "['main.py']"]  # a fresh directory
    assert not [d for d in set(os.listdir(tmp_path.parent.parent)) - before if d.startswith("gdpo-sandbox-")]


def test_errors_are_reported_not_raised():
    result = run_python("def f(:\n", "", LIMITS)
    assert not result.ok and result.returncode == 1 and "SyntaxError" in result.stderr


def test_a_sandbox_that_cannot_start_the_program_raises():
    with pytest.raises(SandboxError, match="did not start"):
        run_python("print('never')", "", SandboxLimits(memory_bytes=1 << 20))


def test_infinite_loop_hits_the_cpu_limit():
    start = time.monotonic()
    result = run_python("while True:\n    pass\n", "", LIMITS)
    assert result.timed_out and not result.ok
    assert time.monotonic() - start < LIMITS.wall_s + 5  # returned, did not hang


@guaranteed("process_tree_ends_with_run")
def test_sleeping_program_hits_the_wall_limit_and_its_tree_is_killed():
    word = marker()
    code = f"import os, sys, time\nif os.fork() == 0:\n    {sleeper(word)}\ntime.sleep(1000)\n"
    result = run_python(code, "", SHORT)
    assert result.timed_out and result.returncode is None
    assert processes_with(word) == []


@guaranteed("process_tree_ends_with_run")
def test_processes_that_leave_the_process_group_are_killed():
    word = marker()
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        {sleeper(word)}\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        "print('parent done')\n"
    )
    result = run_python(code, "", LIMITS)
    assert result.ok and result.stdout == "parent done\n"
    assert processes_with(word) == []


@guaranteed("process_tree_ends_with_run")
def test_zombies_left_behind_do_not_hold_process_slots():
    limits = SandboxLimits(wall_s=5.0, cpu_s=2, memory_bytes=256 << 20, processes=32)
    forks = "import os\nfor _ in range(31):\n    if os.fork() == 0:\n        os._exit(0)\nprint('forked')\n"
    before = set(zombie_children())  # children other tests of this process may have left unreaped
    assert run_python(forks, "", limits).stdout == "forked\n"
    assert set(zombie_children()) <= before
    uses_processes = ("import os\nfor _ in range(5):\n    if (pid := os.fork()) == 0:\n        os._exit(0)\n"
                      "    os.waitpid(pid, 0)\nprint('ran')\n")  # no subprocess: the basic level refuses its imports
    result = run_python(uses_processes, "", limits)
    assert result.ok and result.stdout == "ran\n", result.stderr


@guaranteed("processes_counted_per_run")
def test_fork_bomb_is_contained():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    result = run_python(code, "", SHORT)
    assert not result.ok
    assert time.monotonic() - start < SHORT.wall_s + 5
    assert run_python("print('still works')", "", LIMITS).stdout == "still works\n"  # no slots held


SETUID_HELPERS = ("/usr/lib/polkit-1/polkit-agent-helper-1", "/usr/libexec/polkit-agent-helper-1")


@guaranteed("no_new_privs")
def test_setuid_programs_gain_nothing_and_do_not_survive():
    """A setsid'd grandchild runs a setuid-root helper that blocks on a pipe it holds itself."""
    helper = next((h for h in SETUID_HELPERS if os.path.exists(h) and os.stat(h).st_mode & 0o4000), None)
    word = marker()
    code = (
        "import os, sys, time\n"
        "print(open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0], flush=True)\n"
        f"helper = {helper!r}\n"
        "if helper is None:\n"
        "    sys.exit(0)\n"
        "r, w = os.pipe()\n"
        "pids_r, pids_w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    child = os.fork()\n"
        "    if child == 0:\n"
        "        os.dup2(r, 0)\n"
        "        devnull = os.open('/dev/null', os.O_WRONLY)\n"
        "        os.dup2(devnull, 1)\n"
        "        os.dup2(devnull, 2)\n"
        f"        os.execv(helper, [{word!r}, 'root'])\n"
        "    os.write(pids_w, str(child).encode())\n"
        "    os._exit(0)\n"
        "helper_pid = int(os.read(pids_r, 32))\n"
        "uids = 'exited'  # a helper that is not root refuses to run and exits\n"
        "deadline = time.monotonic() + 2\n"
        "while time.monotonic() < deadline:\n"
        "    try:\n"
        "        status = open(f'/proc/{helper_pid}/status').read()\n"
        "    except OSError:\n"
        "        break\n"
        "    if 'polkit' in status.split()[1]:\n"
        "        uids = [line.split()[1:] for line in status.splitlines() if line.startswith('Uid:')][0]\n"
        "        break\n"
        "    time.sleep(0.01)\n"
        "print(uids)\n"
    )
    result = run_python(code, "", LIMITS)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "1"  # no_new_privs
    if helper is not None and lines[1] != "exited":
        real, effective, saved, _ = eval(lines[1])
        assert effective == real == saved != "0"
    assert processes_with(word) == []


@pytest.mark.parametrize("level", ["default", "basic"])
def test_no_new_privs_at_every_level(level):
    """At the basic level too: a setuid helper started by the program would run as root, and
    one that takes root as its real user id is beyond the sweep over the sandbox's user."""
    code = "print(open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0])\n"
    result = run_python(code, "", LIMITS, level=None if level == "default" else level)
    assert result.ok and result.stdout == "1\n", result.stderr


@guaranteed("private_ipc")
def test_system_v_ipc_objects_end_with_the_run():
    key = random.randrange(1 << 20, 1 << 30)
    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "create = 0o1000 | 0o600\n"
        f"ids = [libc.shmget({key}, 64 << 20, create), libc.msgget({key}, create), libc.semget({key}, 1, create)]\n"
        "print(all(i >= 0 for i in ids))\n"
    )
    try:
        result = run_python(code, "", LIMITS)
        assert result.stdout == "True\n", result.stderr
        assert [kind for kind in ("shm", "msg", "sem") if key in _host_ipc_keys(kind)] == []
    finally:
        _remove_host_ipc(key)


def _host_ipc_keys(kind):
    with open(f"/proc/sysvipc/{kind}") as f:
        return {int(line.split()[0]) for line in f.read().splitlines()[1:]}


def _remove_host_ipc(key):
    """Remove what an uncontained run left on the host."""
    libc, rmid = ctypes.CDLL(None, use_errno=True), 0
    if (ident := libc.shmget(key, 0, 0)) >= 0:
        libc.shmctl(ident, rmid, None)
    if (ident := libc.msgget(key, 0)) >= 0:
        libc.msgctl(ident, rmid, None)
    if (ident := libc.semget(key, 0, 0)) >= 0:
        libc.semctl(ident, 0, rmid)


@guaranteed("no_host_unix_sockets")
def test_host_unix_sockets_are_unreachable(tmp_path):
    paths = [str(tmp_path / "host.sock")]
    if os.access("/run", os.W_OK):
        paths.append(f"/run/gdpo-test-{os.getpid()}.sock")
    abstract = f"\0gdpo-test-{os.getpid()}"
    servers = []
    try:
        for address in paths + [abstract]:
            server = socket.socket(socket.AF_UNIX)
            server.bind(address)
            if not address.startswith("\0"):
                os.chmod(address, 0o777)  # connectable by any user
            server.listen()
            server.settimeout(0.2)
            servers.append(server)
        code = (
            "import socket\n"
            f"for address in {paths + [abstract]!r}:\n"
            "    try:\n"
            "        socket.socket(socket.AF_UNIX).connect(address)\n"
            "        print('connected', repr(address))\n"
            "    except OSError as e:\n"
            "        print('blocked', type(e).__name__)\n"
        )
        result = run_python(code, "", LIMITS)
        assert result.ok and "connected" not in result.stdout
        assert result.stdout.count("blocked") == len(servers)
        for server in servers:
            with pytest.raises(socket.timeout):
                server.accept()
    finally:
        for server in servers:
            server.close()
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


def test_memory_hog_fails_with_memory_error():
    result = run_python("x = bytearray(2 << 30)\nprint('allocated')", "", LIMITS)
    assert not result.ok and "MemoryError" in result.stderr and "allocated" not in result.stdout


@guaranteed("memory_per_run")
def test_memory_is_bounded_per_run_not_per_process():
    """Five processes of 150 MiB each, under a 256 MiB bound: at most one can hold it."""
    limits = SandboxLimits(wall_s=20.0, cpu_s=5, memory_bytes=256 << 20, processes=16)
    code = (
        "import os, time\n"
        "children = []\n"
        "for _ in range(5):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = b'x' * (150 << 20)\n"
        "        time.sleep(2)\n"
        "        os._exit(0)\n"
        "    children.append(pid)\n"
        "print(sum(os.waitpid(pid, 0)[1] == 0 for pid in children))\n"
    )
    result = run_python(code, "", limits)
    assert result.memory_limited and not result.ok
    assert result.stdout == "" or int(result.stdout) <= 1


@guaranteed("memory_per_run")
def test_memory_held_outside_the_address_space_is_bounded_per_run():
    """memfd files are outside RLIMIT_AS: 512 files of 1 MiB under a 256 MiB bound."""
    limits = SandboxLimits(wall_s=20.0, cpu_s=5, memory_bytes=256 << 20, output_bytes=1 << 20, processes=16)
    code = (
        "import os\n"
        "files = []\n"
        "for _ in range(512):\n"
        "    files.append(os.memfd_create('x'))\n"
        "    os.write(files[-1], b'x' * (1 << 20))\n"
        "print(len(files))\n"
    )
    result = run_python(code, "", limits)
    assert result.memory_limited and not result.ok and result.stdout == ""


@guaranteed("disk_bounded")
def test_disk_writes_are_bounded():
    limits = SandboxLimits(wall_s=10.0, cpu_s=5, memory_bytes=256 << 20, output_bytes=2 << 20, disk_bytes=8 << 20)
    code = (
        "import errno, os\n"
        "written = 0\n"
        "for n, where in enumerate(('.', '/tmp', '/dev/shm', '/var/tmp', '/')):\n"
        "    for i in range(64):\n"
        "        try:\n"
        "            with open(os.path.join(where, f'f{n}-{i}'), 'wb') as f:\n"
        "                f.write(b'x' * (1 << 20))\n"
        "            written += 1\n"
        "        except OSError as e:\n"
        "            break\n"
        "print(written)\n"
    )
    result = run_python(code, "", limits)
    assert result.ok, result.stderr
    assert 1 <= int(result.stdout) <= 8


def test_huge_output_is_capped():
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "", LIMITS)
    assert result.output_limited and not result.ok
    assert len(result.stdout) == LIMITS.output_bytes and set(result.stdout) == {"x"}


@guaranteed("host_files_hidden")
def test_host_files_are_hidden():
    code = (
        "import os\n"
        "print(sorted(os.listdir('/')))\n"
        f"for path in ('/etc/passwd', {os.path.abspath(__file__)!r}, {os.getcwd()!r}):\n"
        "    print(os.path.exists(path))\n"
    )
    result = run_python(code, "", LIMITS)
    assert result.ok, result.stderr
    top, *seen = result.stdout.splitlines()
    assert set(eval(top)) <= {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
    assert seen == ["False"] * 3


@guaranteed("writes_confined")
def test_writes_outside_the_working_directory_are_contained(tmp_path):
    outside = tmp_path / "escape.txt"
    in_tmp = f"/tmp/gdpo-escape-{os.getpid()}.txt"
    targets = [str(outside), in_tmp, "/work/escape.txt", "/root/escape.txt", "/usr/escape.txt"]
    code = (
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "    except OSError:\n"
        "        pass\n"
    )
    assert run_python(code, "", LIMITS).ok
    assert [path for path in targets if os.path.exists(path)] == []


def test_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("GDPO_TEST_SECRET", "hunter2")
    code = (
        "import os\n"
        "print(sorted(os.environ))\n"
        f"for pid in (os.getppid(), 1, {os.getpid()}):\n"
        "    try:\n"
        "        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as e:\n"
        "        print('denied', type(e).__name__)\n"
    )
    result = run_python(code, "", LIMITS)
    assert result.ok and "hunter2" not in result.stdout and "GDPO_TEST_SECRET" not in result.stdout
    scrubbed = ["PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED"]
    seen = [name for name in eval(result.stdout.splitlines()[0]) if name != "PWD"]  # bubblewrap sets PWD
    assert seen == sorted(scrubbed)


@pytest.mark.parametrize("level", ["default", "basic"])
def test_no_network(level):
    if level == "default" and not sandbox.isolation().guarantees["no_network"]:
        pytest.skip("the default level here is 'basic'")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        code = (
            "try:\n"
            "    import socket\n"
            f"    socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)\n"
            "    print('connected')\n"
            "except (ImportError, OSError) as e:\n"
            "    print('blocked', type(e).__name__)\n"
        )
        result = run_python(code, "", LIMITS, level=None if level == "default" else level)
        with pytest.raises(socket.timeout):
            server.accept()
    expected = ("blocked ModuleNotFoundError",) if level == "basic" else ("blocked OSError", "blocked ConnectionRefusedError")
    assert result.ok and result.stdout.strip() in expected


@guaranteed("caller_unreachable")
def test_signals_do_not_reach_the_caller():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        code = (
            "import os, signal\n"
            f"for target in ({os.getpid()}, os.getppid(), 1, -1):\n"
            "    try:\n"
            "        os.kill(target, signal.SIGUSR1)\n"
            "    except OSError:\n"
            "        pass\n"
            "print('alive')\n"
        )
        result = run_python(code, "", LIMITS)
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == []
    assert result.ok and result.stdout == "alive\n"


def test_bad_level_and_limits_are_named():
    with pytest.raises(ValueError, match="sandbox level"):
        run_python("pass", "", LIMITS, level="vm")
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="disk_bytes"):
        SandboxLimits(disk_bytes=0)
