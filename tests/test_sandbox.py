"""The code sandbox contains each escape attempt, and none of them hangs the caller."""
import os
import socket
import time

import pytest

from gdpo_megatron.rewards import sandbox
from gdpo_megatron.rewards.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=1, memory_bytes=256 << 20, output_bytes=64 << 10, processes=16)
# For programs that end by a timeout anyway.
SHORT = SandboxLimits(wall_s=1.0, cpu_s=1, memory_bytes=256 << 20, output_bytes=64 << 10, processes=16)
namespaces_only = pytest.mark.skipif(
    sandbox.isolation() != "namespaces",
    reason="contained only at the 'namespaces' level (root); see gdpo_megatron/rewards/sandbox.py",
)


def leftover_processes():
    """Processes still running (not zombies) under this process's sandbox user id."""
    uid, alive = sandbox.sandbox_uid(os.getpid()), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid and _state(entry.name) != "Z":
                    alive.append(int(entry.name))
            except FileNotFoundError:
                pass
    return alive


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_isolation_levels_are_reported():
    assert sandbox.isolation() in sandbox.ISOLATION_LEVELS
    expected = "netns" if sandbox.isolation() == "namespaces" else "import-guard"
    assert sandbox.network_isolation() == expected


def test_runs_a_program_with_stdin_and_removes_its_directory():
    code = "import os\nprint(input()[::-1])\nprint(os.getcwd())\nopen('f', 'w').write('x')"
    result = run_python(code, "abc\n", LIMITS)
    assert result.ok and result.returncode == 0
    reversed_line, workdir = result.stdout.splitlines()
    assert reversed_line == "cba"
    assert os.path.basename(workdir).startswith(f"gdpo-sandbox-{os.getpid()}-")
    assert not os.path.exists(workdir)


def test_errors_are_reported_not_raised():
    result = run_python("def f(:\n", "", LIMITS)
    assert not result.ok and result.returncode == 1 and "SyntaxError" in result.stderr


def test_infinite_loop_hits_the_cpu_limit():
    start = time.monotonic()
    result = run_python("while True:\n    pass\n", "", LIMITS)
    assert result.timed_out and not result.ok
    assert time.monotonic() - start < LIMITS.wall_s + 5  # returned, did not hang


def test_sleeping_program_hits_the_wall_limit_and_its_tree_is_killed():
    code = (
        "import os, sys, time\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(1000)\n"
        "print(child, flush=True)\n"
        "time.sleep(1000)\n"
    )
    result = run_python(code, "", LIMITS)
    assert result.timed_out and result.returncode is None
    child = int(result.stdout)
    assert not os.path.exists(f"/proc/{child}") or _state(child) == "Z"


@namespaces_only
def test_processes_that_leave_the_process_group_are_killed():
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(1000)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    result = run_python(code, "", LIMITS)
    assert result.ok and result.stdout == "parent done\n"
    assert leftover_processes() == []


@namespaces_only
def test_fork_bomb_is_contained():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    result = run_python(code, "", SHORT)
    assert not result.ok
    assert time.monotonic() - start < SHORT.wall_s + 5
    assert leftover_processes() == []
    assert run_python("print('still works')", "", LIMITS).stdout == "still works\n"  # no slots held by zombies


def test_memory_hog_fails_with_memory_error():
    result = run_python("x = bytearray(2 << 30)\nprint('allocated')", "", LIMITS)
    assert not result.ok and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_huge_output_is_capped():
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "", LIMITS)
    assert result.output_limited and not result.ok
    assert len(result.stdout) == LIMITS.output_bytes and set(result.stdout) == {"x"}


@namespaces_only
def test_writes_outside_the_working_directory_are_contained(tmp_path):
    outside = tmp_path / "escape.txt"
    in_tmp = f"/tmp/gdpo-escape-{os.getpid()}.txt"
    code = (
        f"for path in [{str(outside)!r}, {in_tmp!r}, '/work/escape.txt', '/root/escape.txt']:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('denied', path, type(e).__name__)\n"
    )
    result = run_python(code, "", LIMITS)
    assert result.ok
    assert f"wrote {in_tmp}" in result.stdout  # to a private /tmp that vanished with the run
    assert result.stdout.count("denied") == 3
    for path in (outside, in_tmp, "/work/escape.txt", "/root/escape.txt"):
        assert not os.path.exists(path)


def test_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("GDPO_TEST_SECRET", "hunter2")
    code = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "try:\n"
        "    print(open(f'/proc/{os.getppid()}/environ', 'rb').read())\n"
        "except OSError as e:\n"
        "    print('denied', type(e).__name__)\n"
    )
    result = run_python(code, "", LIMITS)
    assert result.ok and "hunter2" not in result.stdout and "GDPO_TEST_SECRET" not in result.stdout
    scrubbed = ["PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED"]
    assert result.stdout.splitlines()[0] == str(sorted(scrubbed))
    if sandbox.isolation() == "namespaces":
        assert "denied PermissionError" in result.stdout


@pytest.mark.parametrize("level", ["default", "basic"])
def test_no_network(level):
    if level == "default" and sandbox.isolation() != "namespaces":
        pytest.skip("the default level is 'basic' here")
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
    expected = "blocked ModuleNotFoundError" if level == "basic" else "blocked OSError"
    assert result.ok and result.stdout.startswith(expected)


@namespaces_only
def test_killing_the_parent_is_refused():
    code = (
        "import os, signal\n"
        "for target in (os.getppid(), 1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "        print('killed', target)\n"
        "    except PermissionError:\n"
        "        print('refused')\n"
        "os.kill(-1, signal.SIGKILL)  # every process it may signal: none but its own\n"
        "print('alive')\n"
    )
    result = run_python(code, "", LIMITS)
    assert result.ok and result.stdout == "refused\nrefused\nalive\n"


def test_bad_level_and_limits_are_named():
    with pytest.raises(ValueError, match="sandbox level"):
        run_python("pass", "", LIMITS, level="vm")
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxLimits(cpu_s=0)
