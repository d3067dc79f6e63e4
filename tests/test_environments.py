"""The environment seam: a user's environment named in the config, run in its own process where
a raise or a step past the time limit fails the trajectory, never the caller."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gdpo_megatron.config import ConfigError, EnvironmentConfig, TrainConfig, load_config
from gdpo_megatron.environments import (Call, Trajectory, configured_reference, environment_class,
                                        environment_reference, parse_calls)
from gdpo_megatron.environments.host import EnvironmentFailed, EnvironmentHost
from gdpo_megatron.environments.judge import judge
from gdpo_megatron.errors import InputError
from gdpo_megatron.preflight.validation import check_environment
from gdpo_megatron.tasks import get_task

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "environments" / "shopping_list.py"
SHOPPING = environment_reference("ShoppingList", str(EXAMPLE))

BROKEN = '''
import os
import time
from gdpo_megatron.environments import Environment

TOOLS = [{"name": n, "parameters": {"type": "dict", "properties": {}, "required": []}}
         for n in ("spin", "die", "nap", "fail")]


class Broken(Environment):
    def reset(self, config):
        if config.get("raise"):
            raise RuntimeError("no such scenario")
        return "ready"

    def tools(self):
        return (lambda: TOOLS) if self.__dict__.get("unsendable") else TOOLS

    def start_turn(self, index):
        self.unsendable = True
        return ""

    def call(self, name, arguments):
        if name == "spin":
            while True:
                pass
        if name == "die":
            os._exit(3)
        if name == "nap":
            time.sleep(1)
            return "rested"
        raise ValueError("this call always fails")
'''


@pytest.fixture
def broken(tmp_path):
    path = tmp_path / "broken_env.py"
    path.write_text(BROKEN)
    return environment_reference("Broken", str(path))


def test_a_users_environment_steps_in_its_own_process():
    with EnvironmentHost(SHOPPING, step_timeout_s=30) as host:
        assert host.reset({"items": {"milk": 1}}) == ""
        assert [tool["name"] for tool in host.tools()] == ["add_item", "remove_item", "show_list"]
        result = host.step(parse_calls("[add_item(item='eggs', count=6), remove_item('bread'), add_item(count=2)]"))
    outputs = [r.output for r in result.results]
    assert outputs[0] == '{"items": {"milk": 1, "eggs": 6}}'
    assert outputs[1] == "Error during execution: 'bread is not on the list'" and not result.results[1].refused
    assert result.results[2].refused and "missing required argument 'item'" in outputs[2]
    assert result.observation == "\n".join(outputs) and not result.done


def test_rewards_replay_a_users_environment():
    trajectory = Trajectory.from_texts(SHOPPING, [["[add_item(item='eggs', count=6)]", "Added."],
                                                  ["[add_item(item='tea')]"]])
    judgement = judge(trajectory, {"items": {}}, [["add_item(item='eggs', count=6)"], ["add_item(item='tea')"]])
    assert judgement.valid and judgement.calls_run == 2
    judgement = judge(trajectory, {"items": {}},
                      [["add_item(item='eggs', count=6)"], ["add_item(item='tea', count=2)"]])
    assert judgement.first_failure == (1, "state")


def test_a_call_that_raises_is_an_error_result_the_trajectory_goes_on(broken):
    with EnvironmentHost(broken, step_timeout_s=30) as host:
        assert host.reset({}) == "ready"
        (result,) = host.step([Call("fail")]).results
        assert result.error and result.output == "Error during execution: this call always fails"
        assert host.tools()  # still there


@pytest.mark.parametrize("request_, why", [
    (lambda host: host.reset({"raise": True}), "reset raised RuntimeError: no such scenario"),
    (lambda host: host.step([Call("die")]), "the environment's process died"),
    (lambda host: (host.start_turn(1), host.tools()), "the result of tools cannot be sent back"),
])
def test_an_environment_that_fails_fails_the_trajectory(broken, request_, why):
    host = EnvironmentHost(broken, step_timeout_s=30)
    if "reset" not in why:
        host.reset({})
    with pytest.raises(EnvironmentFailed, match=why):
        request_(host)
    assert host._process is None  # closed: nothing of it is left running
    with pytest.raises(EnvironmentFailed, match="is closed"):
        host.tools()


def test_an_environment_that_cannot_be_built_fails_the_trajectory(broken):
    with pytest.raises(EnvironmentFailed, match=r"building environment .*defines no class 'Nope' \(environment "
                                                r"classes there: Broken\)"):
        EnvironmentHost(broken.replace(":Broken", ":Nope"), step_timeout_s=30)


def test_a_step_past_its_time_limit_is_killed(broken):
    host = EnvironmentHost(broken, step_timeout_s=1.0)
    host.reset({})
    pid = host._process.pid
    start = time.monotonic()
    with pytest.raises(EnvironmentFailed, match="step ran past the time limit of 1 s"):
        host.step([Call("spin")])
    assert time.monotonic() - start < 30
    assert host._process is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped


# A rank that holds a host, killed while its request runs (a lost peer's os._exit, NCCL's
# SIGABRT and the OOM killer end it just as abruptly: no clean-up of its own).
KILLED_HOLDER = """
import os, signal, sys
from gdpo_megatron.environments import Call
from gdpo_megatron.environments.host import EnvironmentHost

if __name__ == "__main__":
    host = EnvironmentHost(sys.argv[1], step_timeout_s=30)
    host.reset({})
    host._conn.send(("step", ([Call(sys.argv[2])],)))
    print(host._process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (its parent is gone too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("call", ["nap", "spin"])
def test_an_environment_ends_quietly_with_the_process_that_holds_it(broken, tmp_path, call):
    """The holder dies while its environment runs a call, one that returns or one stuck in a
    loop: the environment's process ends at once, without a word."""
    script = tmp_path / "holder.py"
    script.write_text(KILLED_HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), broken, call], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    child = None
    try:
        child = int(holder.stdout.readline())
        assert holder.wait(timeout=60) == -9
        deadline = time.monotonic() + 30
        while not _ended(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _ended(child)
        # Read to the end: every process that shares the holder's stderr (forkserver, child) has exited.
        _, err = holder.communicate(timeout=30)
    finally:
        holder.kill()
        if child is not None and not _ended(child):
            os.kill(child, signal.SIGKILL)
    assert err == ""


def test_the_config_names_a_users_environment_and_preflight_checks_it(tmp_path):
    config = load_config(TrainConfig, "configs/tiny_cpu.yaml",
                         [f"environment.file={EXAMPLE}", "environment.name=ShoppingList"])
    assert config.environment == EnvironmentConfig(name="ShoppingList", file=str(EXAMPLE))
    check_environment(config.environment, "environment")
    assert environment_class(SHOPPING).__name__ == "ShoppingList"
    with pytest.raises(ConfigError, match="environment.name: expected the name of the environment class"):
        load_config(TrainConfig, "configs/tiny_cpu.yaml", [f"environment.file={EXAMPLE}"])
    with pytest.raises(InputError, match=r"^environment.file: ValueError: environment file .* defines no class "
                                         r"'Shopping' \(environment classes there: ShoppingList\)$"):
        check_environment(EnvironmentConfig(name="Shopping", file=str(EXAMPLE)), "environment")
    bad = tmp_path / "bad_env.py"
    bad.write_text("import no_such_module_here\n")
    with pytest.raises(InputError, match="^environment.file: ModuleNotFoundError: No module named"):
        check_environment(EnvironmentConfig(name="X", file=str(bad)), "environment")
    with pytest.raises(InputError, match="^environment.file: .*missing.py does not exist"):
        check_environment(EnvironmentConfig(name="X", file=str(tmp_path / "missing.py")), "environment")
    not_one = tmp_path / "not_one.py"
    not_one.write_text("class X:\n    pass\n")
    with pytest.raises(InputError, match="is not a subclass of gdpo_megatron.environments.Environment"):
        check_environment(EnvironmentConfig(name="X", file=str(not_one)), "environment")
    with pytest.raises(InputError, match="^environment.name: ValueError: environment 'nope': expected a built-in"):
        check_environment(EnvironmentConfig(name="nope"), "environment")
    check_environment(EnvironmentConfig(name="bfcl"), "environment")


def test_a_runs_environment_is_the_configs_else_the_familys():
    assert configured_reference(EnvironmentConfig(), get_task("bfcl_multi_turn").environment) == "bfcl"
    assert configured_reference(EnvironmentConfig(), get_task("tool").environment) is None
    mine = EnvironmentConfig(name="ShoppingList", file=str(EXAMPLE))
    assert configured_reference(mine, "bfcl") == SHOPPING
