"""``env: {type: tools}``: a text task whose agent may call tools before it answers.

:class:`ToolEnv` wraps any gymnasium env whose observations and actions are text (the
"task"). Each action is one turn of the agent (mmrl/tools/calls.py reads it):

- a turn with tool calls runs them (mmrl/tools) and returns their results as the next
  observation, reward 0; the task does not step;
- a turn without a call is the answer: the task steps with it and scores it (its reward,
  termination and ``info["success"]`` pass through);
- a call that cannot be read, names no known tool or fails comes back as an error
  observation (``Error: ...``) and the episode goes on;
- a call beyond ``max_calls`` (unreadable ones count) ends the episode, truncated, reward 0.

``info["tool_calls"]`` and ``info["tool_errors"]`` count the episode's calls and failed calls
so far (also under ``info["costs"]``, which the env sampler logs per episode as
``cost/tool_calls`` and ``cost/tool_errors``). The first observation is the task's, followed by the tools and how to call them
(``call_format``), unless ``instructions: false`` (a sampler that renders
``env.tool_schemas`` with the chat template's ``tools=``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

import gymnasium
from gymnasium import spaces

from mmrl.config import option
from mmrl.env_wrappers import WrapperConfig, apply_wrappers, async_vector_env
from mmrl.envs.gym import GymEnvConfig, resolve_gym_id
from mmrl.errors import ConfigError
from mmrl.registry import ENVS
from mmrl.tools.calls import CallFormat, format_result, instructions, parse_turn
from mmrl.tools.sandbox import SandboxConfig, check_sandbox, require_backend
from mmrl.tools.tool import Tool, call_tool, make_tools

# what observations and actions may hold: printable ASCII and whitespace (a tool's output may
# hold any character; gymnasium's Text space checks are not applied to it)
CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n\t"


@dataclass
class ToolEnvConfig(GymEnvConfig):
    """A text task (a gymnasium id) whose agent calls tools before it answers."""

    type: str = option("tools", "registered name of this component (see `mmrl list`)")
    id: str = option("mmrl/LongArithmetic-v0", "gymnasium id of the text task (text observations and actions) that scores the answer")
    tools: list[str] = option(factory=lambda: ["calculator"], doc="built-in tools (calculator, python) or user functions as 'package.module:function'")
    max_calls: int = option(4, "tool calls an episode may make (unreadable ones count); one more ends it, truncated", ge=0)
    call_format: Literal["json", "hermes"] = option("json", "the call form the first observation teaches (both are always read): json lines, or hermes <tool_call> blocks")
    instructions: bool = option(True, "append the tools and the call form to the first observation (false: the sampler renders tool_schemas)")
    max_text: int = option(4096, "longest observation or action, characters; a longer observation is cut with a marker", ge=256)
    sandbox: SandboxConfig = option(factory=SandboxConfig, doc="where and under which limits the python tool runs code")

    def validate(self, path: str) -> None:
        super().validate(path)
        make_tools(self.tools, self.sandbox, f"{path}.tools" if path else "tools")


class ToolEnv(gymnasium.Wrapper):
    """Tool calls in the agent's turns run and answer back; the answer steps the task."""

    def __init__(
        self, env: gymnasium.Env, tools: list[str] | dict[str, Tool] = ("calculator",), *, sandbox: SandboxConfig | None = None,
        max_calls: int = 4, call_format: CallFormat = "json", instructions: bool = True, max_text: int = 4096,
    ):
        super().__init__(env)
        self.tools = tools if isinstance(tools, dict) else make_tools(list(tools), sandbox)
        self.tool_schemas = [tool.schema() for tool in self.tools.values()]  # for apply_chat_template(tools=...)
        self.max_calls, self.call_format, self.instructions, self.max_text = max_calls, call_format, instructions, max_text
        self.observation_space = spaces.Text(max_length=max_text, charset=CHARSET)
        self.action_space = spaces.Text(max_length=max_text, charset=CHARSET)
        self.calls = self.errors = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = self.env.reset(seed=seed, options=options)
        self.calls = self.errors = 0
        if self.instructions:
            obs = f"{obs}\n\n{instructions(self.tools, self.call_format)}"
        return self._cut(obs), self._info(info)

    def step(self, action: str):
        turn = parse_turn(str(action))
        if not turn.calls and not turn.errors:
            obs, reward, terminated, truncated, info = self.env.step(turn.answer)
            return self._cut(obs), reward, terminated, truncated, self._info(info)
        results = []
        for error in turn.errors:
            if self.calls >= self.max_calls:
                return self._out_of_calls()
            self.calls, self.errors = self.calls + 1, self.errors + 1
            results.append(f"Error: {error}")
        for call in turn.calls:
            if self.calls >= self.max_calls:
                return self._out_of_calls()
            result = call_tool(self.tools, call)
            self.calls, self.errors = self.calls + 1, self.errors + result.error
            results.append(format_result(call.name, result.text, self.call_format))
        return self._fit(results), 0.0, False, False, self._info({})

    def _out_of_calls(self):
        return f"No tool calls left (at most {self.max_calls}).", 0.0, False, True, self._info({})

    def _info(self, info: dict) -> dict:
        # also as the episode's costs so far: the env sampler logs them per episode (cost/tool_calls)
        counts = {"tool_calls": float(self.calls), "tool_errors": float(self.errors)}
        return {"success": False, **info, "tool_calls": self.calls, "tool_errors": self.errors, "costs": counts}

    def _fit(self, results: list[str]) -> str:
        """A turn's tool results in ``max_text``: the shorter ones whole, each longer one cut to
        a fair share of what is left, keeping its head and its last lines, where the python
        tool says how the run ended (``[output limit ...]``, ``[exit status 1]``)."""
        separator = "\n\n"
        if len(separator.join(results)) <= self.max_text:
            return separator.join(results)
        room = self.max_text - len(separator) * (len(results) - 1)
        fitted = list(results)
        for left, i in enumerate(sorted(range(len(results)), key=lambda i: len(results[i]))):
            share = room // (len(results) - left)
            fitted[i] = _head_and_tail(results[i], share)
            room -= len(fitted[i])
        return separator.join(fitted)

    def _cut(self, text: str) -> str:
        text = str(text)
        if len(text) <= self.max_text:
            return text
        marker = f"\n[cut at {self.max_text} characters]"
        return text[: self.max_text - len(marker)] + marker


def _head_and_tail(text: str, limit: int) -> str:
    """``text`` in ``limit`` characters: whole if it fits, else its head, a marker saying how
    much was cut, and its last lines (up to a quarter of ``limit``)."""
    widest = len(f"\n[... {len(text)} characters cut ...]\n")
    if len(text) <= limit or limit < 2 * widest:
        return text[:limit]
    tail = ""
    for line in reversed(text.split("\n")):
        if len(tail) + len(line) + 1 > limit // 4:
            break
        tail = f"\n{line}{tail}"
    tail = tail[1:] or text[-(limit // 4) :]
    head = max(0, limit - len(tail) - widest)
    return f"{text[:head]}\n[... {len(text) - head - len(tail)} characters cut ...]\n{tail}"


def _make_tool_env(env_id: str, max_episode_steps: int | None, kwargs: dict, wrappers: list[WrapperConfig], cfg: ToolEnvConfig) -> ToolEnv:
    # module level, so that async workers started with spawn unpickle it by reference
    task = apply_wrappers(gymnasium.make(env_id, max_episode_steps=max_episode_steps, **kwargs), wrappers)
    return ToolEnv(
        task, cfg.tools, sandbox=cfg.sandbox, max_calls=cfg.max_calls, call_format=cfg.call_format,
        instructions=cfg.instructions, max_text=cfg.max_text,
    )


_checked: dict[str, tuple[bool, str]] = {}


@ENVS.register("tools", config=ToolEnvConfig)
def make_vector_env(cfg: ToolEnvConfig, seed: int) -> gymnasium.vector.VectorEnv:
    """A text task whose agent calls tools (calculator, python, user functions) before it answers.

    A config whose tools run code checks once per process that the sandbox runs here, so a
    broken sandbox stops the run instead of turning every call into an error observation.
    """
    env_id = resolve_gym_id(cfg.id, "env.id")
    for i, wrapper in enumerate(cfg.wrappers):
        wrapper.validate(f"env.wrappers[{i}]")
    tools = make_tools(cfg.tools, cfg.sandbox, "env.tools")
    if any(tool.uses_sandbox for tool in tools.values()):
        require_backend(cfg.sandbox, "env.sandbox.backend")
        key = repr(cfg.sandbox)
        if key not in _checked:
            _checked[key] = check_sandbox(cfg.sandbox)
        ok, detail = _checked[key]
        if not ok:
            raise ConfigError("env.sandbox.backend", cfg.sandbox.backend, f"the sandbox cannot run code here ({detail}); `mmrl doctor` checks it, docs/agents.md lists the backends")
    make_one = partial(_make_tool_env, env_id, cfg.max_episode_steps, dict(cfg.kwargs), list(cfg.wrappers), cfg)
    if cfg.vectorization == "async":
        env = async_vector_env(make_one, cfg.num_envs, context=cfg.context, shared_memory=False)  # text goes through pipes
    else:
        env = gymnasium.vector.SyncVectorEnv([make_one] * cfg.num_envs)
    env.action_space.seed(seed)
    return env
