"""The tool env: a call runs and answers back, an answer steps the task and is scored, tool
use is counted; its config, the long-arithmetic task, and the sandbox backends' refusals."""

from __future__ import annotations

import json
import logging

import gymnasium
import pytest

from mmrl.config import from_dict
from mmrl.envs.tool_env import ToolEnv
from mmrl.errors import ConfigError
from mmrl.registry import ENVS
from mmrl.tasks.long_arithmetic.env import LongArithmeticEnv, stated_answer
from mmrl.tools import sandbox
from mmrl.tools.sandbox import SandboxConfig, run_python


def call(expression: str) -> str:
    return '{"tool": "calculator", "arguments": {"expression": "%s"}}' % expression


def tool_env(**kwargs) -> ToolEnv:
    return ToolEnv(LongArithmeticEnv(digits=15), **kwargs)


def test_episode_call_then_answer_is_scored_by_the_task():
    env = tool_env(tools=["calculator"])
    obs, info = env.reset(seed=3)
    expression = env.unwrapped.expression
    assert obs.startswith(f"Compute {expression} exactly.") and "- calculator: " in obs
    assert info == {"success": False, "tool_calls": 0, "tool_errors": 0, "costs": {"tool_calls": 0.0, "tool_errors": 0.0}}
    obs, reward, terminated, truncated, info = env.step(f"I will use the calculator.\n{call(expression)}")
    assert obs == f"Result of calculator:\n{env.unwrapped.value}"
    assert (reward, terminated, truncated, info) == (0.0, False, False, {"success": False, "tool_calls": 1, "tool_errors": 0, "costs": {"tool_calls": 1.0, "tool_errors": 0.0}})
    obs, reward, terminated, truncated, info = env.step(f"Answer: {int(obs.splitlines()[1]):,}")
    assert (obs, reward, terminated, truncated) == ("Correct.", 1.0, True, False)
    assert info == {"success": True, "tool_calls": 1, "tool_errors": 0, "costs": {"tool_calls": 1.0, "tool_errors": 0.0}}


def test_wrong_answer_scores_zero_and_reset_clears_the_counts():
    env = tool_env()
    env.reset(seed=0)
    env.step(call("1 +"))
    _, reward, terminated, _, info = env.step("Answer: 12")
    assert (reward, terminated, info["success"], info["tool_calls"], info["tool_errors"]) == (0.0, True, False, 1, 1)
    assert env.reset(seed=1)[1]["tool_calls"] == 0


def test_malformed_and_unknown_calls_are_error_observations_and_the_episode_goes_on():
    env = tool_env(call_format="hermes")
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>')
    assert obs.startswith("Error: the <tool_call> block is not valid JSON") and not (terminated or truncated)
    obs, *_, info = env.step('<tool_call>{"name": "abacus", "arguments": {}}</tool_call>')
    assert obs == "<tool_response>\nError: no tool named 'abacus'; tools: calculator\n</tool_response>"
    assert (info["tool_calls"], info["tool_errors"]) == (2, 2)


def test_calls_beyond_max_calls_end_the_episode_truncated():
    env = tool_env(max_calls=2)
    env.reset(seed=0)
    for _ in range(2):
        assert env.step(call("1 + 1"))[0] == "Result of calculator:\n2"
    obs, reward, terminated, truncated, info = env.step(call("1 + 1"))
    assert (obs, reward, terminated, truncated, info["success"], info["tool_calls"]) == ("No tool calls left (at most 2).", 0.0, False, True, False, 2)


def test_long_tool_output_is_cut_to_max_text():
    env = ToolEnv(LongArithmeticEnv(), tools=["calculator"], max_text=256, instructions=False)
    obs, _ = env.reset(seed=0)
    assert "calculator" not in obs and env.tool_schemas[0]["function"]["name"] == "calculator"
    obs = env.step(call("10 ** 900"))[0]
    assert 200 < len(obs) <= 256 and obs.startswith("Result of calculator:\n1000") and "characters cut ...]\n" in obs
    task = ToolEnv(LongArithmeticEnv(digits=400), tools=["calculator"], max_text=256)
    first, _ = task.reset(seed=0)  # the task's own text keeps its head
    assert len(first) == 256 and first.endswith("[cut at 256 characters]")


@pytest.mark.parametrize("call_format", ["json", "hermes"])
def test_a_flooding_programs_observation_still_ends_with_how_it_ended(call_format):
    env = ToolEnv(LongArithmeticEnv(), tools=["python"], sandbox=SandboxConfig(backend="limits_only", wall_seconds=10), call_format=call_format)
    env.reset(seed=0)
    flood = json.dumps({"tool": "python", "arguments": {"code": "while True:\n    print('x' * 1000)"}})
    failing = json.dumps({"tool": "python", "arguments": {"code": "for i in range(3000):\n    print(i)\nraise SystemExit(3)"}})
    obs = env.step(flood)[0]
    assert len(obs) <= 4096 and "characters cut ...]" in obs
    ending = "[output limit (16384 bytes)]" + ("\n</tool_response>" if call_format == "hermes" else "")
    assert obs.endswith(ending), obs[-300:]
    obs = env.step(f"{flood}\n{failing}")[0]  # two results share the room, each keeps its end
    assert len(obs) <= 4096 and obs.count("characters cut ...]") == 2
    assert "[output limit (16384 bytes)]" in obs and "2999\n[exit status 3]" in obs


def test_long_arithmetic_task_is_seeded_and_checked_exactly():
    env = LongArithmeticEnv(digits=20, terms=4)
    first, again = env.reset(seed=7)[0], env.reset(seed=7)[0]
    assert first == again and env.value == eval(env.expression)  # noqa: S307 - our own digits and operators
    assert env.step(f"so it is {env.value + 1}")[1] == 0.0
    assert env.step(f"so it is {env.value}")[1:] == (1.0, True, False, {"success": True})
    assert stated_answer("1_000_000 or 2,000,000") == 2000000 and stated_answer("none") is None


def test_tools_env_config_builds_a_vector_env():
    cfg = from_dict(ENVS.entry("tools").config, {"type": "tools", "num_envs": 2, "tools": ["calculator"], "max_calls": 1, "sandbox": {"cpu_seconds": 2}}, "env")
    assert cfg.id == "mmrl/LongArithmetic-v0" and cfg.sandbox.cpu_seconds == 2
    env = ENVS.get("tools")(cfg, 0)
    try:
        assert isinstance(env.single_action_space, gymnasium.spaces.Text)
        obs, info = env.reset(seed=[1, 2])
        obs, reward, terminated, truncated, info = env.step((call("2 * 3"), "Answer: 0"))
        assert obs[0] == "Result of calculator:\n6" and terminated.tolist() == [False, True]
        assert info["tool_calls"].tolist() == [1, 0]
    finally:
        env.close()


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"^env.tools\[0\]: got 'abacus'; known tools"):
        from_dict(ENVS.entry("tools").config, {"type": "tools", "tools": ["abacus"]}, "env")
    with pytest.raises(ConfigError, match=r"^env.sandbox.command: .*backend 'command' needs"):
        from_dict(ENVS.entry("tools").config, {"type": "tools", "sandbox": {"backend": "command"}}, "env")


def test_missing_bwrap_is_a_one_line_config_error(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    with pytest.raises(ConfigError) as e:
        run_python("print(1)")
    assert str(e.value).startswith("sandbox.backend: got 'bwrap'; bubblewrap is not installed: apt-get install bubblewrap")
    assert "limits_only" in str(e.value) and "\n" not in str(e.value)
    cfg = from_dict(ENVS.entry("tools").config, {"type": "tools", "tools": ["calculator", "python"]}, "env")
    with pytest.raises(ConfigError, match=r"^env.sandbox.backend: got 'bwrap'; bubblewrap is not installed"):
        ENVS.get("tools")(cfg, 0)
    ENVS.get("tools")(from_dict(ENVS.entry("tools").config, {"type": "tools", "num_envs": 1}, "env"), 0).close()  # no code tool: no sandbox needed


def test_limits_only_warns_once_what_is_lost_and_still_limits(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="mmrl.tools.sandbox"):
        first = run_python("print('hi')", backend="limits_only")
        slow = run_python("import time\ntime.sleep(30)", backend="limits_only", wall_seconds=0.5)
    warnings = [r.getMessage() for r in caplog.records if r.name == "mmrl.tools.sandbox" and "limits_only" in r.getMessage()]
    assert len(warnings) == 1 and "code runs with CPU, memory" in warnings[0] and "network" in warnings[0] and "environment" in warnings[0]
    assert first.stdout == "hi\n" and first.ok
    assert slow.timed_out and slow.killed_reason == "wall-clock timeout (0.5 s)"


def test_command_backend_runs_the_code_under_the_given_prefix():
    prefix = ["sh", "-c", 'test -f "{workdir}/main.py" && echo prefix ran >&2 && exec "$@"', "sh"]
    result = run_python("import os\nprint(os.path.basename(os.getcwd()).startswith('mmrl-sandbox-'))", SandboxConfig(backend="command", command=prefix))
    assert (result.stdout, result.stderr, result.ok) == ("True\n", "prefix ran\n", True)
