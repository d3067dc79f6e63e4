"""The environment seam: a user's environment named in the config, run in a pooled worker process
where a raise or a step past the time limit fails the trajectory (and the worker), never the
caller, and a reused worker shows a trajectory nothing of the one before it."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gdpo_megatron.config import ConfigError, EnvironmentConfig, TrainConfig, load_config
from gdpo_megatron.environments import (Call, configured_reference, environment_class,
                                        environment_reference, parse_calls)
from gdpo_megatron.environments.episode import Episode
from gdpo_megatron.environments.host import EnvironmentFailed, EnvironmentHost, EnvironmentPool
from gdpo_megatron.environments.trajectory import Trajectory
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


def _pid(host: EnvironmentHost) -> int:
    return host._worker.process.pid


def _ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (its parent is gone too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between open and read
        return True


def test_a_users_environment_steps_in_its_own_process():
    with EnvironmentPool(SHOPPING, step_timeout_s=30) as pool, pool.host() as host:
        assert host.reset({"items": {"milk": 1}}) == ""
        assert _pid(host) != os.getpid()
        assert [tool["name"] for tool in host.tools()] == ["add_item", "remove_item", "show_list"]
        result = host.step(parse_calls("[add_item(item='eggs', count=6), remove_item('bread'), add_item(count=2)]"))
    outputs = [r.output for r in result.results]
    assert outputs[0] == '{"items": {"milk": 1, "eggs": 6}}'
    assert outputs[1] == "Error during execution: 'bread is not on the list'" and not result.results[1].refused
    assert result.results[2].refused and "missing required argument 'item'" in outputs[2]
    assert result.observation == "\n".join(outputs) and not result.done


def test_requests_to_many_environments_are_sent_before_any_answer_is_read():
    with EnvironmentPool(SHOPPING, step_timeout_s=30) as pool:
        hosts = pool.hosts(3)
        assert len({_pid(h) for h in hosts}) == 3  # a worker each
        for n, host in enumerate(hosts):
            host.send("reset", {"items": {"milk": n}})
            host.send("step", parse_calls(f"[add_item(item='tea', count={n + 1})]"))
        observations = [host.receive().observation for host in reversed(hosts)]
        assert observations == [f'{{"items": {{"milk": {n}, "tea": {n + 1}}}}}' for n in (2, 1, 0)]


def _episode(pool: EnvironmentPool, later_turns: list, **limits) -> Episode:
    host = pool.host()
    host.reset({"items": {"milk": 1}})
    return Episode(SHOPPING, host, [{"role": "user", "content": "Add six eggs."}], later_turns, **limits)


def _say(episode: Episode, text: str) -> list[dict] | None:
    return episode.advance(text, episode.send_calls(text))


def test_an_episode_answers_calls_with_tool_messages_and_feeds_the_next_user_turn():
    later = [[{"role": "user", "content": "Now add tea."}]]
    add, remove = "[add_item(item='eggs', count=6)]", "[remove_item(item='bread')]"
    with EnvironmentPool(SHOPPING, step_timeout_s=30) as pool:
        episode = _episode(pool, later, max_steps_per_turn=2)
        assert _say(episode, add) == [{"role": "tool", "content": '{"items": {"milk": 1, "eggs": 6}}'}]
        # the turn's second message is its last: its calls still run, then the next user turn follows
        assert _say(episode, remove) == [{"role": "tool", "content": "Error during execution: 'bread is not on "
                                                                     "the list'"}, *later[0]]
        assert _say(episode, "[]") is None  # an empty call block answers the last user turn
        assert episode.ending == "answered" and episode.host is None and episode.failure is None
        assert episode.trajectory() == Trajectory.from_texts(SHOPPING, [[add, remove], ["[]"]])

        episode = _episode(pool, later, max_steps_per_turn=1, max_steps=1)
        assert _say(episode, "Nothing to add.") is None  # the last message of all, its next turn never answered
        assert episode.ending == "max_steps"
        assert episode.trajectory() == Trajectory.from_texts(SHOPPING, [["Nothing to add."]])

        episode = _episode(pool, [], max_steps_per_turn=1)
        assert _say(episode, add) is None and episode.ending == "turn_limit"


def test_a_worker_serves_the_next_trajectory_with_a_new_environment(broken):
    with EnvironmentPool(broken, step_timeout_s=30) as pool:
        first = pool.host()
        first.reset({})
        first.start_turn(1)  # its object's tools() cannot be sent back from now on
        pid = _pid(first)
        first.close()
        second = pool.host()
        assert _pid(second) == pid and pool.workers == 1  # the same process
        assert second.reset({}) == "ready"
        assert [t["name"] for t in second.tools()] == ["spin", "die", "nap", "fail"]  # nothing of the first's
        second.close()
    with EnvironmentPool(SHOPPING, step_timeout_s=30) as pool:  # the state a call leaves goes with it too
        with pool.host() as host:
            host.reset({"items": {"milk": 1}})
            host.step(parse_calls("[add_item(item='eggs')]"))
        with pool.host() as host:
            host.reset({})
            assert pool.workers == 1 and host.step([Call("show_list")]).observation == '{"items": {}}'


def test_a_call_that_raises_is_an_error_result_the_trajectory_goes_on(broken):
    with EnvironmentPool(broken, step_timeout_s=30) as pool, pool.host() as host:
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
    with EnvironmentPool(broken, step_timeout_s=30) as pool:
        host = pool.host()
        pid = _pid(host)
        if "reset" not in why:
            host.reset({})
        with pytest.raises(EnvironmentFailed, match=why):
            request_(host)
        assert host._worker is None and pool.workers == 0 and _ended(pid)  # killed: nothing of it is left
        with pytest.raises(EnvironmentFailed, match="is closed"):
            host.tools()
        with pool.host() as next_one:  # the pool starts another worker
            assert _pid(next_one) != pid and next_one.reset({}) == "ready"


def test_an_environment_that_cannot_be_built_fails_the_trajectory(broken):
    with EnvironmentPool(broken.replace(":Broken", ":Nope"), step_timeout_s=30) as pool:
        host = pool.host()
        with pytest.raises(EnvironmentFailed, match=r"building environment .*defines no class 'Nope' \(environment "
                                                    r"classes there: Broken\)"):
            host.reset({})
        assert pool.workers == 0


def test_a_step_past_its_time_limit_is_killed_and_its_worker_replaced(broken):
    with EnvironmentPool(broken, step_timeout_s=1.0) as pool:
        stuck, other = pool.hosts(2)
        stuck.reset({})
        other.reset({})
        pid = _pid(stuck)
        start = time.monotonic()
        with pytest.raises(EnvironmentFailed, match="step ran past the time limit of 1 s"):
            stuck.step([Call("spin")])
        assert time.monotonic() - start < 30
        assert stuck._worker is None and _ended(pid)  # killed and reaped
        assert other.step([Call("fail")]).results[0].error  # the other trajectory goes on
        other.close()
        fresh = pool.hosts(2)
        assert pool.workers == 2 and pid not in {_pid(h) for h in fresh}
        assert [h.reset({}) for h in fresh] == ["ready", "ready"]


def test_closing_the_pool_ends_every_worker(broken):
    pool = EnvironmentPool(broken, step_timeout_s=30)
    idle, held, busy = pool.hosts(3)
    for host in (idle, held, busy):
        host.reset({})
    pids = [_pid(h) for h in (idle, held, busy)]
    idle.close()
    busy.send("step", [Call("nap")])
    busy.close()  # a request unanswered: the worker is killed, not reused
    assert _ended(pids[2]) and pool.workers == 2
    pool.close()
    assert pool.workers == 0 and all(_ended(pid) for pid in pids)
    with pytest.raises(EnvironmentFailed):
        held.tools()


# A rank that holds a pool, killed while its request runs (a lost peer's os._exit, NCCL's
# SIGABRT and the OOM killer end it just as abruptly: no clean-up of its own).
KILLED_HOLDER = """
import os, signal, sys
from gdpo_megatron.environments import Call
from gdpo_megatron.environments.host import EnvironmentPool

if __name__ == "__main__":
    pool = EnvironmentPool(sys.argv[1], step_timeout_s=30)
    idle, host = pool.hosts(2)
    idle.reset({})
    idle.close()
    host.reset({})
    host.send("step", [Call(sys.argv[2])])
    print(idle._pool._idle[0].process.pid, host._worker.process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("call", ["nap", "spin"])
def test_an_environment_ends_quietly_with_the_process_that_holds_it(broken, tmp_path, call):
    """The holder dies while an environment runs a call, one that returns or one stuck in a
    loop, and another worker waits idle: both workers end at once, without a word."""
    script = tmp_path / "holder.py"
    script.write_text(KILLED_HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), broken, call], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    workers = []
    try:
        workers = [int(pid) for pid in holder.stdout.readline().split()]
        assert holder.wait(timeout=60) == -9
        deadline = time.monotonic() + 30
        while not all(_ended(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(workers) == 2 and all(_ended(pid) for pid in workers)
        # Read to the end: every process that shares the holder's stderr (forkserver, workers) has exited.
        _, err = holder.communicate(timeout=30)
    finally:
        holder.kill()
        for pid in workers:
            if not _ended(pid):
                os.kill(pid, signal.SIGKILL)
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
