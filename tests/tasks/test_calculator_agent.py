"""The calculator-agent task: demonstrations that solve mmrl/LongArithmetic-v0 through the tool
env, and the tool-use counts read from saved episodes (benchmarks/agent_tool_use.py)."""

from __future__ import annotations

import importlib.util
import json

from mmrl.tasks.long_arithmetic.demos import calculator_episode, main
from mmrl.tasks.long_arithmetic.env import LongArithmeticEnv
from mmrl.tools.calls import parse_turn
from tests.conftest import ROOT


def test_a_demonstration_calls_the_calculator_with_the_expression_and_answers_its_result():
    for seed in range(5):
        (first, call), (result, answer) = calculator_episode(seed, digits=6, terms=2)
        env = LongArithmeticEnv(digits=6, terms=2)
        observation, _ = env.reset(seed=seed)
        assert first == observation  # no tool instructions: the form the demonstrations teach
        parsed = parse_turn(call)
        assert [c.name for c in parsed.calls] == ["calculator"] and parsed.calls[0].arguments == {"expression": env.expression}
        assert result == f"Result of calculator:\n{env.value}" and answer == f"Answer: {env.value}"


def test_the_demos_command_writes_the_conversations_format(tmp_path):
    out = tmp_path / "demos.jsonl"
    assert main(["--out", str(out), "--episodes", "3", "--seed", "7", "--digits", "4"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["turns"]) == 2 for r in rows)
    assert rows[0]["turns"] == calculator_episode(7, digits=4)


def _tool_use():
    spec = importlib.util.spec_from_file_location("agent_tool_use", ROOT / "benchmarks" / "agent_tool_use.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tool_use


def test_tool_use_counts_correct_calls_and_copied_results(tmp_path):
    solved = calculator_episode(3, digits=6, terms=2)
    wrong_call = [[solved[0][0], json.dumps({"tool": "calculator", "arguments": {"expression": "1 + 1"}})], ["Result of calculator:\n2", "Answer: 2"]]
    unread = [[solved[0][0], '{"tool": "calculator", "arguments": '], ["Error: ...", "Answer: 5"]]
    miscopied = [solved[0], [solved[1][0], "Answer: 12"]]
    rows = [{"turns": t, "success": s} for t, s in ((solved, True), (wrong_call, False), (unread, False), (miscopied, False))]
    (tmp_path / "episodes.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    stats = _tool_use()(tmp_path)
    assert stats["episodes"] == 4 and stats["success"] == 0.25 and stats["turns"] == 2.0
    assert stats["calls"] == 1.0 and stats["readable_calls"] == 0.75
    assert stats["correct_calls"] == 0.5  # the solved and the miscopied episodes called it right
    assert stats["answer_copies_result"] == 0.25  # only the solved one copied the result
