"""The code sandbox contains each escape attempt, and none of them hangs the caller.

One test per attack class, run under each way the sandbox can isolate a run here: ``bwrap``
(skipped where bubblewrap cannot run), ``basic`` in namespaces of its own (as root) and
``basic`` in the host's namespaces (what it does without them). A test of a property a setup
does not guarantee (see ``sandbox.isolation()``) is skipped, with the reason; the guarantees
themselves come from a probe run, and these tests attack them.
"""
import ctypes
import errno
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from gdpo_megatron.rewards import sandbox
from gdpo_megatron.rewards.coding import ProgramRefused, code_no_bug, code_pass
from gdpo_megatron.rewards.sandbox import SandboxedRun, SandboxError, SandboxLimits, Setup, run_python, seccomp

# Generous wall time: a loaded 2-core machine can take seconds to start an interpreter.
LIMITS = SandboxLimits(wall_s=10.0, cpu_s=1, memory_bytes=256 << 20, output_bytes=64 << 10, processes=16)
# For programs that end by a timeout anyway.
SHORT = SandboxLimits(wall_s=1.0, cpu_s=1, memory_bytes=256 << 20, output_bytes=64 << 10, processes=16)
ROOT = os.geteuid() == 0
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


@pytest.fixture(scope="module", params=["bwrap", "basic", "basic-host"])
def level(request):
    """The Isolation of one setup, as its probe measured it here."""
    if request.param == "bwrap":
        why = sandbox.bwrap_missing()
        if why is not None:
            pytest.skip(f"bubblewrap cannot run here: {why}")
        return sandbox.isolation("bwrap")
    if request.param == "basic":
        return sandbox.isolation("basic")
    return sandbox.probe(Setup("basic"))


def run(code, level, limits=LIMITS, stdin="", pass_fds=()):
    return SandboxedRun({"main.py": code}, stdin, limits, level.setup, pass_fds).finish(time.monotonic() + limits.wall_s)


def requires(level, key):
    assert key in dict(sandbox.GUARANTEES)
    if not level.guarantees[key]:
        pytest.skip(f"{level.describe()} does not guarantee {key}")


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


def syscall(name, args):
    """Program text: system call ``name`` through libc's syscall() with ``args`` (program text);
    its errno, or 0 when it succeeded."""
    return (f"(lambda r: 0 if r >= 0 else ctypes.get_errno())(libc.syscall(ctypes.c_long({seccomp.syscall_number(name)}), "
            f"*map(ctypes.c_long, ({args},))))")


LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"


# ---- what is reported ----------------------------------------------------------------------------


def test_isolation_is_reported_per_guarantee(level):
    assert level.level in sandbox.ISOLATION_LEVELS
    assert set(level.guarantees) == {key for key, _ in sandbox.GUARANTEES}
    text = str(level)
    assert all(description in text for _, description in sandbox.GUARANTEES)
    # What every setup must hold, or it is not used at all.
    assert all(level.guarantees[key] for key in ("no_new_privs", "syscalls_filtered", "no_network", "private_ipc"))
    if level.setup.has_init:  # a root of its own in namespaces of its own
        assert all(level.guarantees[key] for key in ("process_tree_ends_with_run", "host_files_hidden",
                                                     "writes_confined", "disk_bounded", "no_host_unix_sockets"))
    else:
        assert not level.guarantees["writes_confined"] and not level.guarantees["host_files_hidden"]


@pytest.fixture
def path_of(monkeypatch):
    """Set PATH (where the sandbox looks for bwrap) and probe the levels again under it; the
    weaker level is not chosen until a test chooses it."""
    def set_path(directory):
        monkeypatch.setenv("PATH", str(directory))
        sandbox.isolation.cache_clear()
        sandbox.default_setup.cache_clear()

    yield set_path
    monkeypatch.undo()
    sandbox.allow_weaker(False)
    sandbox.isolation.cache_clear()  # probed again with the PATH restored
    sandbox.default_setup.cache_clear()


def test_without_bubblewrap_runs_are_refused_unless_the_weaker_level_is_chosen(path_of, tmp_path, caplog):
    path_of(tmp_path)  # no bwrap on it
    assert sandbox.bwrap_missing() == "bubblewrap (bwrap) is not installed"
    assert sandbox.isolation().level == "basic"
    with pytest.raises(SandboxError, match=r"bubblewrap \(bwrap\) is not installed\) and the weaker basic level was "
                                           r"not chosen .*sandbox.allow_weaker\(True\)"):
        run_python("print(1)", "", LIMITS)
    with pytest.raises(SandboxError, match="not chosen"):
        code_pass("```python\nprint(1)\n```", 0, {"tests": [{"input": "", "output": "1"}]})
    assert run_python("print(0)", "", LIMITS, level="basic").stdout == "0\n"  # a level named is a level chosen
    sandbox.allow_weaker(True)
    with caplog.at_level("WARNING", logger="gdpo_megatron.rewards.sandbox.levels"):
        assert run_python("print(1)", "", LIMITS).stdout == "1\n"
        assert run_python("print(2)", "", LIMITS).stdout == "2\n"
    warnings = [r.getMessage() for r in caplog.records if "weaker isolation" in r.getMessage()]
    assert len(warnings) == 1 and "basic" in warnings[0] and "bwrap) is not installed" in warnings[0], caplog.text


@pytest.mark.skipif(sandbox.bwrap_missing() is not None, reason="needs a working bubblewrap to wrap")
def test_a_bwrap_that_shares_the_hosts_network_is_not_the_strong_level(path_of):
    """A ``bwrap`` on PATH that adds ``--share-net`` runs, but its runs see the host's network
    namespace (and its abstract unix sockets): measured, so refused as the bwrap level."""
    real = shutil.which("bwrap")
    wrapper_dir = Path(tempfile.mkdtemp())
    try:
        wrapper_dir.chmod(0o755)  # the sandbox's own users run it, as root
        wrapper = wrapper_dir / "bwrap"
        wrapper.write_text(f'#!/bin/sh\nfirst="$1"\nshift\nexec {real} "$first" --share-net "$@"\n')
        wrapper.chmod(0o755)
        path_of(wrapper_dir)
        with pytest.raises(SandboxError, match=rf"{wrapper} does not isolate as bubblewrap must \(the host's net "
                                               r"namespace; not held: no_host_unix_sockets\)"):
            sandbox.isolation("bwrap")
        assert sandbox.isolation().level == "basic"
        assert sandbox.bwrap_missing().startswith(f"{wrapper} does not isolate as bubblewrap must")
        with pytest.raises(SandboxError, match="not chosen"):
            run_python("print(1)", "", LIMITS)
    finally:
        shutil.rmtree(wrapper_dir)


# ---- runs, errors and limits ---------------------------------------------------------------------


def test_runs_a_program_with_stdin_and_leaves_no_directory(level, tmp_path):
    before = set(os.listdir(tmp_path.parent.parent))
    code = "import os\nprint(input()[::-1])\nprint(sorted(os.listdir('.')))\nopen('f', 'w').write('x')"
    result = run(code, level, stdin="abc\n")
    assert result.ok and result.returncode == 0
    assert result.stdout.splitlines() == ["cba", "['main.py']"]
    assert run(code, level, stdin="xy\n").stdout.splitlines() == ["yx", "['main.py']"]  # a fresh directory
    assert not [d for d in set(os.listdir(tmp_path.parent.parent)) - before if d.startswith("gdpo-sandbox-")]


def test_a_correct_program_may_use_the_standard_library(level):
    """No import is refused: processes, threads, asyncio (an AF_UNIX socketpair), multiprocessing
    (POSIX semaphores in /dev/shm)."""
    code = (
        "import asyncio, multiprocessing, subprocess, sys, threading\n"
        "print(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout.strip())\n"
        "print(asyncio.run(asyncio.sleep(0, result='async')))\n"
        "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
        "if __name__ == '__main__':\n"
        "    with multiprocessing.get_context('fork').Pool(2) as pool:\n"
        "        print(sum(pool.map(abs, [-1, -2, 3])))\n"
    )
    result = run(code, level, SandboxLimits(wall_s=20.0, cpu_s=5, memory_bytes=512 << 20, processes=16))
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == ["42", "async", "thread", "6"]


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_worker_processes_run_the_programs_own_functions(level, start_method):
    """``main.py`` runs as the ``__main__`` module, as ``python main.py`` runs it: a Pool or a
    ProcessPoolExecutor pickles the program's functions by reference, and a spawned worker
    imports ``__main__`` again from its file."""
    code = (
        "import concurrent.futures, multiprocessing, sys\n"
        "def square(x):\n"
        "    return x * x\n"
        "class Offset:\n"
        "    def __init__(self, by):\n"
        "        self.by = by\n"
        "    def __call__(self, x):\n"
        "        return x + self.by\n"
        "if __name__ == '__main__':\n"
        f"    context = multiprocessing.get_context({start_method!r})\n"
        "    with context.Pool(2) as pool:\n"
        "        print(pool.map(square, [1, 2, 3]), pool.map(Offset(10), [1, 2]))\n"
        "    with concurrent.futures.ProcessPoolExecutor(2, mp_context=context) as executor:\n"
        "        print(list(executor.map(square, [4, 5])))\n"
        "    print(sys.argv, __file__)\n"
    )
    result = run(code, level, SandboxLimits(wall_s=60.0, cpu_s=10, memory_bytes=512 << 20, processes=16))
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == ["[1, 4, 9] [11, 12]", "[16, 25]", "['main.py'] main.py"]


@pytest.fixture(scope="module")
def venv_python():
    """A virtual environment (outside /tmp, which runs replace, and readable by the sandbox's
    users) of a Python other users may run, holding one installed distribution: gdpo-marker 1.2."""
    base = sandbox.run.interpreter()
    home = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        home.chmod(0o755)
        subprocess.run([base, "-m", "venv", "--without-pip", str(home / "venv")], check=True, timeout=120)
        site = subprocess.run([str(home / "venv/bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (Path(site) / "gdpo_marker.py").write_text("VALUE = 42\n")
        (Path(site) / "gdpo_marker-1.2.dist-info").mkdir()
        (Path(site) / "gdpo_marker-1.2.dist-info/METADATA").write_text("Metadata-Version: 2.1\nName: gdpo-marker\nVersion: 1.2\n")
        base_version = subprocess.run([base, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                                      text=True, check=True).stdout.strip()
        yield str(home / "venv/bin/python"), base_version
    finally:
        shutil.rmtree(home)


@pytest.fixture
def chosen_python():
    """Choose an interpreter for the test's runs; the default again after it."""
    yield sandbox.use_python
    sandbox.use_python(None)


def test_a_chosen_interpreter_brings_its_packages(level, venv_python, chosen_python):
    python, base_version = venv_python
    assert "gdpo-marker" not in sandbox.programs_python().packages
    assert not run("import gdpo_marker", level).ok
    chosen_python(python)
    result = run("import gdpo_marker, sys\nprint(gdpo_marker.VALUE, sys.prefix != sys.base_prefix)", level)
    assert result.ok, result.stderr
    assert result.stdout == "42 True\n"
    described = sandbox.programs_python()
    assert (described.path, described.version, described.packages) == (python, base_version, {"gdpo-marker": "1.2"})
    assert str(described) == f"{python} (Python {base_version}, 1 packages, no numpy)"


def test_the_reward_stage_runs_programs_with_the_configured_interpreter(venv_python):
    from gdpo_megatron.config.rewards import RewardSpec
    from gdpo_megatron.rewards import RewardStage

    completion = "```python\nimport gdpo_marker\nprint(gdpo_marker.VALUE)\n```"
    truth = {"tests": [{"input": "", "output": "42"}]}
    for python, expected in ((None, 0.0), (venv_python[0], 1.0)):
        with RewardStage([RewardSpec("code_pass")], num_workers=1, allow_weaker_sandbox=True,  # whatever level runs here
                         sandbox_python=python) as stage:
            rewards, metrics = stage.score([completion], [10], [truth])
        assert rewards.tolist() == [[expected]] and metrics["reward/code_pass/failures"] == 0, python


def test_an_interpreter_that_cannot_run_programs_is_refused_saying_why(tmp_path, chosen_python):
    in_tmp = tmp_path / "python3"  # tmp_path is under /tmp
    in_tmp.symlink_to(sandbox.run.interpreter())
    refusals = {"python3": "not an absolute path", "/nonexistent/python3": "no such file",
                "/bin/true": "it is not Python 3.8 or later", str(in_tmp): "runs replace /tmp, /dev and /proc"}
    private = Path(tempfile.mkdtemp(dir="/var/tmp"))  # mode 700
    try:
        if ROOT:
            (private / "python3").symlink_to(sandbox.run.interpreter())
            refusals[str(private / "python3")] = "other users cannot run it"
        for path, why in refusals.items():
            with pytest.raises(SandboxError, match=rf"^sandbox: the interpreter {path} cannot run programs: {why}"):
                chosen_python(path)
            assert sandbox.python_problem(path).startswith(why)
    finally:
        shutil.rmtree(private)
    assert sandbox.run.interpreter() != "/bin/true"  # the runs' interpreter is unchanged


def test_errors_are_reported_not_raised(level):
    result = run("def f(:\n", level)
    assert not result.ok and result.returncode == 1 and "SyntaxError" in result.stderr


def test_a_sandbox_that_cannot_start_the_program_raises(level):
    with pytest.raises(SandboxError, match="did not start"):
        run("print('never')", level, SandboxLimits(memory_bytes=1 << 20))


def test_infinite_loop_hits_the_cpu_limit(level):
    start = time.monotonic()
    result = run("while True:\n    pass\n", level)
    assert result.timed_out and not result.ok
    assert time.monotonic() - start < LIMITS.wall_s + 5  # returned, did not hang


def test_memory_hog_fails_with_memory_error(level):
    result = run("x = bytearray(2 << 30)\nprint('allocated')", level)
    assert not result.ok and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_huge_output_is_capped(level):
    result = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", level)
    assert result.output_limited and not result.ok
    assert len(result.stdout) == LIMITS.output_bytes and set(result.stdout) == {"x"}


def test_bad_level_and_limits_are_named():
    with pytest.raises(ValueError, match="sandbox level"):
        run_python("pass", "", LIMITS, level="vm")
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="disk_bytes"):
        SandboxLimits(disk_bytes=0)


# ---- processes ------------------------------------------------------------------------------------


def test_sleeping_program_hits_the_wall_limit_and_its_tree_is_killed(level):
    requires(level, "process_tree_ends_with_run")
    word = marker()
    code = f"import os, sys, time\nif os.fork() == 0:\n    {sleeper(word)}\ntime.sleep(1000)\n"
    result = run(code, level, SHORT)
    assert result.timed_out and result.returncode is None
    assert processes_with(word) == []


def test_processes_that_leave_the_process_group_are_killed(level):
    requires(level, "process_tree_ends_with_run")
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
    result = run(code, level)
    assert result.ok and result.stdout == "parent done\n"
    assert processes_with(word) == []


def test_a_program_that_reparents_a_child_to_outlive_its_time_limit(level):
    """A daemon (setsid, double fork) keeps writing to a pipe the caller reads; the program
    itself sleeps past its wall time. Once ``finish`` returns, every holder of the pipe's write
    end is gone: the caller reads to its end at once."""
    requires(level, "process_tree_ends_with_run")
    reader, writer = os.pipe()
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        while True:\n"
        f"            os.write({writer}, b'.')\n"
        "            time.sleep(0.01)\n"
        "    os._exit(0)\n"
        "time.sleep(1000)\n"
    )
    try:
        result = SandboxedRun({"main.py": code}, "", SHORT, level.setup, (writer,)).finish(time.monotonic() + SHORT.wall_s)
        os.close(writer)
        writer = None
        assert result.timed_out
        os.set_blocking(reader, False)
        drained = b""
        while chunk := os.read(reader, 1 << 16):  # EOF (b"") rather than BlockingIOError: no writer is left
            drained += chunk
        assert drained and set(drained) == {ord(".")}
    finally:
        os.close(reader)
        if writer is not None:
            os.close(writer)


def test_zombies_left_behind_do_not_hold_process_slots(level):
    requires(level, "process_tree_ends_with_run")
    limits = SandboxLimits(wall_s=5.0, cpu_s=2, memory_bytes=256 << 20, processes=32)
    forks = "import os\nfor _ in range(31):\n    if os.fork() == 0:\n        os._exit(0)\nprint('forked')\n"
    before = set(zombie_children())  # children other tests of this process may have left unreaped
    assert run(forks, level, limits).stdout == "forked\n"
    assert set(zombie_children()) <= before
    uses_processes = "import subprocess\nfor _ in range(5):\n    subprocess.run(['true'], check=True)\nprint('ran')\n"
    result = run(uses_processes, level, limits)
    assert result.ok and result.stdout == "ran\n", result.stderr


def test_fork_bomb_is_contained(level):
    requires(level, "processes_counted_per_run")
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    result = run(code, level, SHORT)
    assert not result.ok
    assert time.monotonic() - start < SHORT.wall_s + 5
    assert run("print('still works')", level).stdout == "still works\n"  # no slots held


SETUID_HELPERS = ("/usr/lib/polkit-1/polkit-agent-helper-1", "/usr/libexec/polkit-agent-helper-1")


def test_setuid_programs_gain_nothing_and_do_not_survive(level):
    """A setsid'd grandchild runs a setuid-root helper that blocks on a pipe it holds itself."""
    requires(level, "process_tree_ends_with_run")
    helper = next((h for h in SETUID_HELPERS if os.path.exists(h) and os.stat(h).st_mode & 0o4000), None)
    word = marker()
    code = (
        "import os, sys, time\n"
        "print(open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0], flush=True)\n"
        f"helper = {helper!r}\n"
        "if helper is None or not os.path.exists(helper):\n"
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
    result = run(code, level)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "1"  # no_new_privs
    if len(lines) > 1 and lines[1] != "exited":
        real, effective, saved, _ = eval(lines[1])
        assert effective == real == saved != "0"
    assert processes_with(word) == []


def test_signals_do_not_reach_the_caller_or_its_process_group(level):
    requires(level, "caller_unreachable")
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        code = (
            "import os, signal\n"
            f"for pid in ({os.getpid()}, os.getppid(), 1):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGUSR1)\n"
            "    except OSError:\n"
            "        pass\n"
            f"for group in ({os.getpgid(0)},):\n"
            "    try:\n"
            "        os.killpg(group, signal.SIGUSR1)\n"
            "    except OSError:\n"
            "        pass\n"
            "try:\n"
            "    os.kill(-1, signal.SIGUSR1)\n"
            "except OSError:\n"
            "    pass\n"
            "print('alive')\n"
        )
        result = run(code, level)
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == []
    assert result.ok and result.stdout == "alive\n"


def test_the_caller_cannot_be_traced_or_read(level):
    """ptrace (attach, seize, traceme) and process_vm_readv of the caller, of the run's parent
    and of pid 1 (bubblewrap's init, or the sandbox's) are refused; so is kcmp."""
    code = (
        LIBC +
        "import os\n"
        "buffer = (ctypes.c_char * 8)()\n"
        "iov = (ctypes.c_void_p * 2)(ctypes.addressof(buffer), 8)\n"
        f"for pid in ({os.getpid()}, os.getppid(), 1):\n"
        f"    print({syscall('ptrace', '16, pid, 0, 0')}, {syscall('ptrace', '0x4206, pid, 0, 0')},\n"
        f"          {syscall('process_vm_readv', 'pid, ctypes.addressof(iov), 1, ctypes.addressof(iov), 1, 0')})\n"
        f"print({syscall('ptrace', '0, 0, 0, 0')}, {syscall('kcmp', 'os.getpid(), os.getpid(), 0, 0, 0')})\n"
    )
    result = run(code, level)
    assert result.ok, result.stderr
    assert result.stdout.split() == [str(errno.EPERM)] * 11


# ---- the kernel surface: the system call filter and the keyrings ---------------------------------


def test_the_system_call_filter(level):
    checks = {
        "keyctl": ("keyctl", "0, -3, 0"), "add_key": ("add_key", "0, 0, 0, 0, -3"),
        "request_key": ("request_key", "0, 0, 0, -3"), "io_uring_setup": ("io_uring_setup", "1, 0"),
        "userfaultfd": ("userfaultfd", "0"), "memfd_secret": ("memfd_secret", "0"), "bpf": ("bpf", "0, 0, 0"),
        "perf_event_open": ("perf_event_open", "0, 0, -1, -1, 0"), "unshare_user": ("unshare", "0x10000000"),
        "unshare_net": ("unshare", "0x40000000"), "setns": ("setns", "0, 0"), "mount": ("mount", "0, 0, 0, 0, 0"),
        "pivot_root": ("pivot_root", "0, 0"),
    }
    code = LIBC + "import json, os\nout = {}\n"
    code += "".join(f"out[{name!r}] = {syscall(*call)}\n" for name, call in checks.items())
    code += (
        "r = libc.syscall(ctypes.c_long(NR_CLONE), ctypes.c_long(0x40000000 | 17), 0, 0, 0, 0)\n"
        "if r == 0:\n"
        "    os._exit(0)\n"
        "out['clone_newnet'] = 0 if r > 0 else ctypes.get_errno()\n"
        "out['tiocsti'] = 0 if libc.ioctl(0, 0x5412, ctypes.byref(ctypes.c_char(b'x'))) == 0 else ctypes.get_errno()\n"
        "print(json.dumps(out))\n"
    ).replace("NR_CLONE", str(seccomp.syscall_number("clone")))
    result = run(code, level)
    assert result.ok, result.stderr
    assert json.loads(result.stdout) == {
        **{name: errno.ENOSYS for name in ("keyctl", "add_key", "request_key", "io_uring_setup", "userfaultfd",
                                           "memfd_secret", "bpf", "perf_event_open")},
        **{name: errno.EPERM for name in ("unshare_user", "unshare_net", "setns", "mount", "pivot_root",
                                          "clone_newnet", "tiocsti")},
    }


def test_no_socket_but_unix_and_no_network(level):
    """The families are refused at creation (AF_VSOCK only created, never connected: it would
    reach the hypervisor); a listener on the caller's loopback is never reached."""
    families = {"AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17, "AF_VSOCK": 40, "AF_ALG": 38}
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        code = (
            "import json, socket\n"
            "out = {}\n"
            f"for name, family in {families!r}.items():\n"
            "    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):\n"
            "        try:\n"
            "            socket.socket(family, kind).close()\n"
            "            out[name] = 'created'\n"
            "        except OSError as e:\n"
            "            out.setdefault(name, e.errno)\n"
            "a, b = socket.socketpair()\n"
            "a.sendall(b'unix'); out['AF_UNIX'] = b.recv(4).decode()\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)\n"
            "    out['loopback'] = 'connected'\n"
            "except OSError as e:\n"
            "    out['loopback'] = e.errno\n"
            "print(json.dumps(out))\n"
        )
        result = run(code, level)
        with pytest.raises(socket.timeout):
            server.accept()
    assert result.ok, result.stderr
    assert json.loads(result.stdout) == {**{name: errno.EAFNOSUPPORT for name in families}, "AF_UNIX": "unix",
                                         "loopback": errno.EAFNOSUPPORT}


def test_the_callers_session_keyring_is_out_of_reach(level):
    """The caller holds a key in its session keyring: the run does not possess it (its session
    keyring is its own: /proc/keys lists the keys a process may view), can neither read nor
    unlink it, and leaves nothing in it."""
    add_key, keyctl = seccomp.syscall_number("add_key"), seccomp.syscall_number("keyctl")
    description = f"gdpo-test-{os.getpid()}"
    key = _libc.syscall(ctypes.c_long(add_key), b"user", description.encode(), b"secret",
                        ctypes.c_size_t(6), ctypes.c_int(-3))  # KEY_SPEC_SESSION_KEYRING
    if key < 0 and ctypes.get_errno() == errno.ENOSYS:
        pytest.skip("this kernel has no keyrings")
    assert key > 0, os.strerror(ctypes.get_errno())
    try:
        code = (
            LIBC +
            "buffer = ctypes.create_string_buffer(64)\n"
            f"n = libc.syscall(ctypes.c_long({keyctl}), ctypes.c_long(11), ctypes.c_long({key}), buffer, ctypes.c_long(64))\n"
            "print(buffer.raw[:n] if n >= 0 else ctypes.get_errno())\n"
            f"print({syscall('keyctl', f'9, {key}, -3')})\n"  # KEYCTL_UNLINK from the session keyring
            f"print(libc.syscall(ctypes.c_long({add_key}), b'user', b'left-by-the-run', b'x', ctypes.c_size_t(1), "
            "ctypes.c_int(-3)) >= 0 or ctypes.get_errno())\n"
            f"print({description!r} in open('/proc/keys').read())\n"
        )
        assert description in open("/proc/keys").read()  # the caller's own view
        result = run(code, level)
        assert result.ok, result.stderr
        assert result.stdout.split() == [str(errno.ENOSYS)] * 3 + ["False"]
        buffer = ctypes.create_string_buffer(64)
        assert _libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(11), ctypes.c_long(key), buffer, ctypes.c_long(64)) == 6
        assert buffer.raw[:6] == b"secret"
        left = _libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(10), ctypes.c_long(-3), b"user", b"left-by-the-run",
                             ctypes.c_long(0))  # KEYCTL_SEARCH
        assert left < 0
    finally:
        _libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(21), ctypes.c_long(key))  # KEYCTL_INVALIDATE


@pytest.mark.skipif(platform.machine() != "x86_64", reason="an i386 system call from x86_64 code")
def test_a_call_of_another_abi_kills_the_program_and_fails_the_reward(level):
    """i386's ``int 0x80`` (its numbers mean other calls) kills the process: the result says why,
    and the code rewards raise, so the reward stage counts a failure, not a score."""
    code = (
        "import ctypes, mmap\n"
        "m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
        "m.write(bytes([0xb8, 20, 0, 0, 0, 0xcd, 0x80, 0xc3]))  # mov eax, 20 (getpid); int 0x80; ret\n"
        "getpid = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))\n"
        "print(getpid())\n"
    )
    result = run(code, level)
    assert result.returncode == -signal.SIGSYS and result.refused and "another architecture" in result.refused
    if level.setup == sandbox.isolation().setup:  # the rewards run at the default level
        truth = {"tests": [{"input": "", "output": "1"}]}
        for reward in (code_pass, code_no_bug):
            with pytest.raises(ProgramRefused, match="another architecture"):
                reward(f"```python\n{code}\n```", 0, truth, limits={"wall_s": 10.0})


def test_descriptors_of_the_caller_are_not_inherited(level, tmp_path):
    """Only stdin, stdout, stderr and what the caller passes on purpose are open in the program:
    not the caller's other descriptors (inheritable ones included), nor the sandbox's own (its
    files, its filter, its pipes)."""
    secret = tmp_path / "secret"
    secret.write_text("hunter2")
    leaked = os.open(secret, os.O_RDONLY)
    os.set_inheritable(leaked, True)
    passed_r, passed_w = os.pipe()
    code = ("import os\nlinks = {}\n"
            "for fd in os.listdir('/proc/self/fd'):\n"
            "    try:\n"
            "        links[int(fd)] = os.readlink(f'/proc/self/fd/{fd}')\n"
            "    except FileNotFoundError:  # the listing's own descriptor, closed since\n"
            "        pass\n"
            "print(links)\n")
    try:
        result = SandboxedRun({"main.py": code}, "", LIMITS, level.setup, (passed_w,)).finish(time.monotonic() + 10)
        assert result.ok, result.stderr
        links = eval(result.stdout)
        assert set(links) == {0, 1, 2, passed_w}
        assert links[passed_w] == os.readlink(f"/proc/self/fd/{passed_w}")  # the very pipe
    finally:
        for fd in (leaked, passed_r, passed_w):
            os.close(fd)


# ---- IPC, files, mounts ---------------------------------------------------------------------------


def test_system_v_ipc_objects_do_not_reach_the_host(level):
    key = random.randrange(1 << 20, 1 << 30)
    code = (
        LIBC +
        "create = 0o1000 | 0o600\n"
        f"ids = [libc.shmget({key}, 64 << 20, create), libc.msgget({key}, create), libc.semget({key}, 1, create)]\n"
        "print(['made' if i >= 0 else ctypes.get_errno() for i in ids])\n"
    )
    try:
        result = run(code, level)
        assert result.ok, result.stderr
        made = eval(result.stdout)
        if level.setup.has_init:  # an IPC namespace of its own
            assert made == ["made"] * 3
        else:
            assert made == [errno.ENOSYS] * 3
        assert [kind for kind in ("shm", "msg", "sem") if key in _host_ipc_keys(kind)] == []
    finally:
        _remove_host_ipc(key)


def _host_ipc_keys(kind):
    with open(f"/proc/sysvipc/{kind}") as f:
        return {int(line.split()[0]) for line in f.read().splitlines()[1:]}


def _remove_host_ipc(key):
    """Remove what an uncontained run left on the host."""
    rmid = 0
    if (ident := _libc.shmget(key, 0, 0)) >= 0:
        _libc.shmctl(ident, rmid, None)
    if (ident := _libc.msgget(key, 0)) >= 0:
        _libc.msgctl(ident, rmid, None)
    if (ident := _libc.semget(key, 0, 0)) >= 0:
        _libc.semctl(ident, 0, rmid)


def test_host_unix_sockets_are_unreachable(level, tmp_path):
    requires(level, "no_host_unix_sockets")
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
        result = run(code, level)
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


def test_host_files_are_hidden(level):
    """Nothing of the host but system directories: not /etc, not the test's files, not the
    working directory of the caller (where a dataset with the expected answers would be)."""
    requires(level, "host_files_hidden")
    code = (
        "import os\n"
        "print(sorted(os.listdir('/')))\n"
        f"for path in ('/etc/passwd', {os.path.abspath(__file__)!r}, {os.getcwd()!r}, '/oldroot', '/newroot'):\n"
        "    print(os.path.exists(path))\n"
    )
    result = run(code, level)
    assert result.ok, result.stderr
    top, *seen = result.stdout.splitlines()
    assert set(eval(top)) <= {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
    assert seen == ["False"] * 5


def test_writes_outside_the_working_directory_are_contained(level, tmp_path):
    requires(level, "writes_confined")
    name = f"gdpo-escape-{os.getpid()}.txt"
    targets = [str(tmp_path / name)] + [f"{d}/{name}" for d in ("/tmp", "/dev/shm", "/var/tmp", "/run/lock", "/work",
                                                                 "/root", "/usr")]
    code = (
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "    except OSError:\n"
        "        pass\n"
    )
    try:
        assert run(code, level).ok
        assert [path for path in targets if os.path.exists(path)] == []
    finally:
        for path in targets:
            if os.path.exists(path):
                os.unlink(path)


def test_its_own_mounts_cannot_be_changed(level):
    """No remount of / or /usr read-write, no new tmpfs, no unmounting what hides the host."""
    requires(level, "writes_confined")
    code = (
        LIBC +
        "MS_REMOUNT, MS_BIND = 32, 4096\n"
        "out = []\n"
        "for source, target, fstype, flags in ((None, b'/', None, MS_REMOUNT | MS_BIND), (None, b'/usr', None, MS_REMOUNT | MS_BIND),\n"
        "                                      (b'tmpfs', b'/usr', b'tmpfs', 0), (b'/tmp', b'/usr', None, MS_BIND)):\n"
        "    out.append(0 if libc.mount(source, target, fstype, ctypes.c_ulong(flags), None) == 0 else ctypes.get_errno())\n"
        "out.append(0 if libc.umount2(b'/tmp', 2) == 0 else ctypes.get_errno())\n"
        "try:\n"
        "    open('/usr/gdpo-escape', 'w')\n"
        "    out.append('wrote')\n"
        "except OSError as e:\n"
        "    out.append(e.errno)\n"
        "print(out)\n"
    )
    result = run(code, level)
    assert result.ok, result.stderr
    assert eval(result.stdout) == [errno.EPERM] * 5 + [errno.EROFS]


def test_disk_writes_are_bounded(level):
    requires(level, "disk_bounded")
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
    result = run(code, level, limits)
    assert result.ok, result.stderr
    assert 2 <= int(result.stdout) <= 16  # 8 MiB in the working directory (/tmp), 8 MiB in /dev/shm


def test_memory_is_bounded_per_run_not_per_process(level):
    """Five processes of 150 MiB each, under a 256 MiB bound: at most one can hold it."""
    requires(level, "memory_per_run")
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
    result = run(code, level, limits)
    assert result.memory_limited and not result.ok
    assert result.stdout == "" or int(result.stdout) <= 1


@pytest.mark.parametrize("holder", ["memfd", "tmpfs", "sysv"])
def test_memory_held_outside_the_address_space_is_bounded_per_run(level, holder):
    """memfd files, /dev/shm files and System V segments are outside RLIMIT_AS: 512 MiB of them
    under a 256 MiB bound."""
    requires(level, "memory_per_run")
    if holder != "memfd":
        requires(level, "disk_bounded" if holder == "tmpfs" else "private_ipc")
        if holder == "sysv" and not level.setup.has_init:
            pytest.skip("System V IPC is refused in the host's IPC namespace")
    limits = SandboxLimits(wall_s=20.0, cpu_s=5, memory_bytes=256 << 20, output_bytes=1 << 20, processes=16,
                           disk_bytes=1 << 30)
    hold = {
        "memfd": "fd = os.memfd_create('x')\n    os.write(fd, b'x' * (1 << 20))\n    held.append(fd)\n",
        "tmpfs": "with open(f'/dev/shm/{i}', 'wb') as f:\n        f.write(b'x' * (1 << 20))\n",
        "sysv": ("segment = libc.shmget(0, 1 << 20, 0o1600)\n    address = libc.shmat(segment, None, 0)\n"
                 "    ctypes.memset(address, 1, 1 << 20)\n    libc.shmdt(ctypes.c_void_p(address))\n"),
    }[holder]
    code = LIBC + "libc.shmat.restype = ctypes.c_void_p\nimport os\nheld = []\nfor i in range(512):\n    " + hold + "print(i)\n"
    result = run(code, level, limits)
    assert result.memory_limited and not result.ok and result.stdout == ""


def test_parent_environment_is_not_visible(level, monkeypatch):
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
    result = run(code, level)
    assert result.ok and "hunter2" not in result.stdout and "GDPO_TEST_SECRET" not in result.stdout
    scrubbed = ["PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED"]
    seen = [name for name in eval(result.stdout.splitlines()[0]) if name != "PWD"]  # bubblewrap sets PWD
    assert seen == sorted(scrubbed)
