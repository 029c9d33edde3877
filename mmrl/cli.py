"""The ``mmrl`` command: train, train-reward, eval, list, doctor, plot, collect, serve-reward.

Bad input (config keys, values, types, files, ids) ends with one line naming the field, the
value and what is allowed, and exit code 2 — never a traceback. A fault of code the user
brought (a simulator's env.reset/env.step, an env wrapper, a reward component; in this
process or in a rollout worker) or a non-finite reward or loss ends with one line naming
what raised and where (env or sampler, env index, seed, update, groups) and exit code 1.
``MMRL_DEBUG=1`` in the environment prints the traceback before any such line. An exception
in mmrl's own code is not caught: it keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import traceback
from pathlib import Path

from mmrl.errors import ConfigError, MissingExtraError, NonFiniteError, RolloutWorkerError, UserCodeError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + message by default)
        self.exit(EXIT_USAGE, f"mmrl: error: {message} (see `{self.prog} --help`)\n")


def _number(convert, minimum: float, allowed: str):
    """An argparse ``type`` for a bounded number (a count, a size, a seed, a noise std): out of
    range it would crash deep inside a command or quietly do nothing, so it is refused while
    parsing, by the parser's one-line error naming the option (``argument --episodes: got
    '-3'; expected a positive integer``)."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not minimum <= value < math.inf:  # not NaN or inf either
            raise argparse.ArgumentTypeError(f"got {text!r}; expected {allowed}")
        return value

    return parse


_positive_int = _number(int, 1, "a positive integer")
_non_negative_int = _number(int, 0, "an integer >= 0")
_non_negative_float = _number(float, 0.0, "a finite number >= 0")


def _config_and_dir(target: str, overrides: list[str]):
    """A config file, or a run directory holding config.yaml → (TrainConfig, run_dir|None)."""
    from mmrl.config import load_config
    from mmrl.train.run_config import TrainConfig

    path = Path(target)
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise ConfigError("run_dir", target, "a run directory must hold config.yaml (written by `mmrl train`)")
        return load_config(TrainConfig, path / "config.yaml", overrides), path
    if not path.exists():
        raise ConfigError("config", target, "no such file or run directory")
    return load_config(TrainConfig, path, overrides), None


def cmd_train(args) -> int:
    from mmrl.train.trainer import Trainer

    cfg, run_dir = _config_and_dir(args.config, args.overrides)
    if run_dir is not None and not args.resume:
        raise ConfigError("config", args.config, "is a run directory; pass --resume to continue it")
    if args.run_dir:
        run_dir = Path(args.run_dir)
    trainer = Trainer(cfg, run_dir, resume=args.resume)
    try:
        summary = trainer.train()
    except KeyboardInterrupt:
        step = trainer.checkpointer.latest()
        print(f"mmrl: interrupted; checkpoint {step} written; continue with `mmrl train {trainer.run_dir} --resume`", file=sys.stderr)
        signum = trainer.stop.signum or signal.SIGINT
        return 128 + int(signum)
    evaluation = summary["eval"]
    line = f"mmrl: finished {summary['step']} steps in {summary['wall_clock']:.0f} s; run directory {summary['run_dir']}"
    if "success_rate" in evaluation:
        line += f"; eval success {evaluation['success_rate']:.3f} over {evaluation.get('episodes', '?')} episodes"
    if trainer.rank == 0:
        print(line)
    return 0


def cmd_train_reward(args) -> int:
    """``mmrl train`` of a reward model: the same loop, configs, checkpoints and metrics,
    after checking that the config is one (algo.type sft on a preferences or success_frames
    source, a reward-model policy); ends with the held-out (pairwise or success) accuracy."""
    from mmrl import registry
    from mmrl.policies.reward_model import RewardModel
    from mmrl.train.trainer import Trainer

    cfg, run_dir = _config_and_dir(args.config, args.overrides)
    if run_dir is not None and not args.resume:
        raise ConfigError("config", args.config, "is a run directory; pass --resume to continue it")
    if cfg.algo.type != "sft":
        raise ConfigError("algo.type", cfg.algo.type, "train-reward fits a reward model to preference pairs: set algo.type: sft")
    model = registry.POLICIES.get(cfg.policy.type, "policy.type")
    if not (isinstance(model, type) and issubclass(model, RewardModel)):
        reward_models = [e.name for e in registry.POLICIES.entries() if isinstance(e.obj, type) and issubclass(e.obj, RewardModel)]
        raise ConfigError("policy.type", cfg.policy.type, f"train-reward trains a reward model: {', '.join(reward_models)}")
    if cfg.data.type not in ("preferences", "success_frames"):
        raise ConfigError("data.type", cfg.data.type, "train-reward reads preference pairs (data.type: preferences) or labelled frames of a success classifier (data.type: success_frames)")
    if args.run_dir:
        run_dir = Path(args.run_dir)
    trainer = Trainer(cfg, run_dir, resume=args.resume)
    try:
        summary = trainer.train()
    except KeyboardInterrupt:
        print(f"mmrl: interrupted; checkpoint {trainer.checkpointer.latest()} written; continue with `mmrl train-reward {trainer.run_dir} --resume`", file=sys.stderr)
        return 128 + int(trainer.stop.signum or signal.SIGINT)
    evaluation = summary["eval"]
    line = f"mmrl: finished {summary['step']} steps in {summary['wall_clock']:.0f} s; run directory {summary['run_dir']}"
    if "pairwise_accuracy" in evaluation:
        line += (f"; held-out pairwise accuracy {evaluation['pairwise_accuracy']:.3f} "
                 f"[{evaluation['pairwise_accuracy_ci_low']:.3f}, {evaluation['pairwise_accuracy_ci_high']:.3f}] over {evaluation['pairs']} pairs")
    if "success_accuracy" in evaluation:
        line += (f"; held-out success accuracy {evaluation['success_accuracy']:.3f} [{evaluation['success_accuracy_ci_low']:.3f}, {evaluation['success_accuracy_ci_high']:.3f}], "
                 f"balanced {evaluation['success_balanced_accuracy']:.3f} [{evaluation['success_balanced_accuracy_ci_low']:.3f}, {evaluation['success_balanced_accuracy_ci_high']:.3f}] over {evaluation['held_out_frames']} frames")
    if trainer.rank == 0:
        print(line)
    return 0


def cmd_eval(args) -> int:
    from mmrl.commands.evaluate import evaluate_run

    target = Path(args.target)
    if target.is_dir() and (target / "train_config.yaml").is_file():
        # a checkpoint directory: its run's config is saved beside its weights
        if args.checkpoint is not None:
            raise ConfigError("--checkpoint", args.checkpoint, f"{args.target} is a checkpoint already; give its run directory with --checkpoint, or the checkpoint alone")
        from mmrl.config import load_config
        from mmrl.train.run_config import TrainConfig

        cfg, run_dir, args.checkpoint = load_config(TrainConfig, target / "train_config.yaml", args.overrides), None, str(target)
    else:
        cfg, run_dir = _config_and_dir(args.target, args.overrides)
    if args.suite and args.save_episodes:
        raise ConfigError("--save-episodes", args.save_episodes, "saves the episodes of a plain evaluation; leave out --suite")
    if not args.suite and args.videos is not None:
        raise ConfigError("--videos", args.videos, "writes the videos of a suite evaluation: add --suite (a plain evaluation writes none; --save-episodes keeps every frame)")
    if args.suite:
        from mmrl.commands.evaluate import evaluate_suite
        from mmrl.suites import load_suite

        suite = load_suite(args.suite)
        summary = evaluate_suite(cfg, run_dir, suite, checkpoint=args.checkpoint, out_dir=args.out, episodes_per_task=args.episodes, videos=1 if args.videos is None else args.videos)
        print((Path(summary["out_dir"]) / "results.md").read_text(), end="")
        print(f"mmrl: tables and videos in {summary['out_dir']}")
        return 0
    result = evaluate_run(cfg, run_dir, episodes=args.episodes, checkpoint=args.checkpoint, out_dir=args.out, save_episodes=args.save_episodes)
    print(json.dumps(result, indent=2))
    return 0


def cmd_serve_reward(args) -> int:
    """Serve the ``rewards:`` of a run config over HTTP (the ``remote`` reward's protocol,
    docs/reward_models.md) until interrupted; one line per request on stderr."""
    from mmrl.commands.serve_reward import build_server

    cfg, _ = _config_and_dir(args.config, args.overrides)
    log = None if args.quiet else (lambda line: print(f"mmrl serve-reward: {line}", file=sys.stderr, flush=True))
    server = build_server(cfg, args.host, args.port, log=log)
    names = ", ".join(f"{name} (weight {weight:g})" for name, weight in zip(server.rewards.names, server.rewards.weights))
    print(f"mmrl: serving {names}, combined by {server.rewards.aggregation}, at {server.url} (protocol version {server.version}); Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    print(f"mmrl: stopped serving after {server.requests} requests", flush=True)
    return 0


def listed_registries() -> dict:
    """The registries ``mmrl list KIND`` prints, one line per entry, by kind."""
    from mmrl import registry

    return {
        "envs": registry.ENVS,
        "policies": registry.POLICIES,
        "rewards": registry.REWARDS,
        "samplers": registry.SAMPLERS,
        "advantages": registry.ADVANTAGES,
        "objectives": registry.OBJECTIVES,
        "aggregations": registry.AGGREGATIONS,
        "filters": registry.FILTERS,
        "corrections": registry.CORRECTIONS,
        "losses": registry.LOSSES,
        "kl": registry.KL_ESTIMATORS,
        "engines": registry.ENGINES,
        "data": registry.DATA_SOURCES,
    }


def cmd_list(args) -> int:
    from mmrl.config import list_presets

    if args.kind == "presets":
        for name in list_presets():
            print(name)
        return 0
    if args.kind == "suites":
        for name, description in _suite_lines():
            print(f"{name:26s} {description}")
        return 0
    if args.kind == "tasks":
        for line in _task_lines():
            print(line)
        return 0
    for entry in listed_registries()[args.kind].entries():
        print(f"{entry.name:24s} {entry.doc}")
    if args.kind == "envs":
        import gymnasium

        ids = sorted(i for i in gymnasium.registry if i.startswith("mmrl/"))
        print("\ngymnasium ids shipped with mmrl (use with type: gym):")
        for i in ids:
            print(f"  {i}")
    return 0


def _suite_lines() -> list[tuple[str, str]]:
    """(name, description with its task count and env) of every built-in suite, read from
    the YAML alone: listing needs none of the simulators a suite's env would import."""
    from mmrl.config import load_yaml
    from mmrl.envs.tabletop.tasks import resolve_tasks
    from mmrl.suites import TABLETOP_ID, builtin_suite_dir, list_suites

    lines = []
    for name in list_suites():
        data = load_yaml(builtin_suite_dir() / f"{name}.yaml", "suite")
        env = data.get("env") or {}
        tasks = data.get("tasks") or []
        if env.get("id") == TABLETOP_ID:
            tasks = resolve_tasks(tasks, "tasks")  # family names and `all` count as their tasks
        where = env.get("id") or env.get("suite") or env.get("type", "?")
        lines.append((name, f"{data.get('description', '')} [{len(tasks)} tasks, {where}]".strip()))
    return lines


def _task_lines() -> list[str]:
    """One line per task mmrl knows by name, grouped under a header saying how to select it."""
    from mmrl.envs.maniskill import INSTRUCTIONS
    from mmrl.envs.tabletop.tasks import FAMILIES, TASKS

    lines = [f"mmrl/Tabletop-v0 tasks (type: gym, id: mmrl/Tabletop-v0, kwargs: {{task: NAME}}; or a family: {', '.join(FAMILIES)}, all):"]
    lines += [f"  {name:40s} {task.instruction}" for name, task in TASKS.items()]
    lines += ["", "ManiSkill3 tasks with a built-in instruction (type: maniskill, id: NAME; other ManiSkill ids work too):"]
    lines += [f"  {name:40s} {instruction}" for name, instruction in INSTRUCTIONS.items()]
    lines += ["", "LIBERO tasks (type: libero, suite: SUITE, task: INDEX or name):"]
    try:
        from mmrl.envs.libero import SUITES, suite_tasks

        for suite in SUITES:
            lines += [f"  {f'{suite} {i}':40s} {instruction}" for i, (_, instruction) in enumerate(suite_tasks(suite))]
    except MissingExtraError as e:
        lines.append(f"  (not listed: {e})")
    return lines


def cmd_doctor(args) -> int:
    from mmrl.commands.doctor import report

    return report()


class _ExportHelp(argparse.Action):
    """``mmrl export --help``: the help with every format a policy writes, read from the
    policies (:func:`mmrl.commands.export.layouts_help`) only when asked, as the policies load slowly."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from mmrl.commands.export import layouts_help

        parser.epilog = layouts_help()
        parser.print_help()
        parser.exit()


def cmd_export(args) -> int:
    from mmrl.commands.export import export_policy

    print(export_policy(args.source, args.format, args.out))
    return 0


def cmd_plot(args) -> int:
    from mmrl.commands.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def cmd_pairs(args) -> int:
    from mmrl.commands.pairs import main as pairs_main

    return pairs_main(args.args)


def _collect_plan(args) -> dict:
    """Tasks, episode count and env settings of ``mmrl collect`` from its flags: ``--task``
    names tasks, families or ``all``, or is one suite (a built-in name or a YAML file) whose
    env, tasks and episodes_per_task are used; flags given explicitly win over the suite."""
    from mmrl.commands.collect import TABLETOP_ID
    from mmrl.envs.tabletop.tasks import resolve_tasks
    from mmrl.suites import list_suites, load_suite

    env_id, kwargs, max_steps, episodes = args.env_id or TABLETOP_ID, {}, None, 50
    try:
        tasks = resolve_tasks(args.task, "--task")
    except ConfigError as task_error:
        if len(args.task) != 1:
            raise
        try:
            suite = load_suite(args.task[0])
        except ConfigError as suite_error:
            if suite_error.field != "suite":
                raise
            raise ConfigError("--task", args.task[0], f"{task_error.allowed}; or a suite: {', '.join(list_suites())} or a suite YAML") from None
        tasks, episodes = suite.tasks, suite.episodes_per_task
        env_id = args.env_id or suite.env.get("id")
        kwargs = {k: v for k, v in suite.env.get("kwargs", {}).items() if k != "task"}
        max_steps = suite.env.get("max_episode_steps")
    if args.obs_mode is not None:
        kwargs["obs_mode"] = args.obs_mode
    if kwargs.get("obs_mode") == "state":  # nothing rendered: flags about images cannot apply
        for flag, value in (("--image-size", args.image_size), ("--cameras", args.cameras)):
            if value is not None:
                raise ConfigError(flag, value if isinstance(value, int) else " ".join(value), "sets the recorded images; obs_mode state records none (leave it out, or use --obs-mode rgb)")
    if args.image_size is not None:
        kwargs["image_size"] = args.image_size
    if args.cameras is not None:
        kwargs["cameras"] = args.cameras if len(args.cameras) > 1 else args.cameras[0]
    if args.max_episode_steps is not None:
        max_steps = args.max_episode_steps
    if args.episodes_per_task is not None:
        episodes = args.episodes_per_task
    return {"tasks": tasks, "episodes_per_task": episodes, "env_id": env_id, "env_kwargs": kwargs, "max_episode_steps": max_steps}


def cmd_collect(args) -> int:
    from mmrl.commands.collect import collect, collect_from_config

    if args.config is not None:
        if args.task is not None:
            raise ConfigError("--task", " ".join(args.task), "names tabletop tasks; with --config the run config's env is collected (leave --task out)")
        cfg, _ = _config_and_dir(args.config, args.overrides)
        episodes = args.episodes_per_task or 20
        summary = collect_from_config(cfg, episodes, args.out, seed=args.seed, noise=args.noise, keep_failures=args.keep_failures,
                                      report=lambda line: print(line, flush=True))
        print(f"mmrl: wrote {summary['written']} episodes ({episodes} seeds from {args.seed}, {summary['steps']} env steps; {summary['failed']} failed) to {summary['out']}")
        return 0
    if args.task is None:
        raise ConfigError("--task", None, "name tabletop tasks, families, all or a suite; or pass --config RUN_CONFIG to collect a run config's env")
    if args.overrides:
        raise ConfigError("overrides", " ".join(args.overrides), "apply to --config only")
    plan = _collect_plan(args)
    summary = collect(
        plan["tasks"], plan["episodes_per_task"], args.out, seed=args.seed, env_kwargs=plan["env_kwargs"],
        max_episode_steps=plan["max_episode_steps"], noise=args.noise, keep_failures=args.keep_failures,
        append=args.append, env_id=plan["env_id"], report=lambda line: print(line, flush=True), layout=args.format,
    )
    failed = summary["failed"]
    note = f"{failed} failed" + ("" if args.keep_failures or not failed else " (not written)")
    print(f"mmrl: wrote {summary['written']} episodes ({len(plan['tasks'])} tasks x {plan['episodes_per_task']} seeds from {args.seed}; {note}) to {summary['out']}")
    return 0


def _train_help() -> str:
    from mmrl import registry
    from mmrl.config import describe
    from mmrl.train.run_config import TrainConfig

    lines = ["fields (set in the YAML or as dotted overrides, e.g. algo.objective.eps_high=0.28):", ""]
    for name, tp, default, doc in describe(TrainConfig):
        lines.append(f"  {name:28s} {doc}" + (f"  [{tp}; default {default}]" if tp != "section" else ""))
    sections = (
        ("env", registry.ENVS), ("policy", registry.POLICIES), ("sampler", registry.SAMPLERS), ("rewards[i]", registry.REWARDS),
        ("algo.advantage", registry.ADVANTAGES), ("algo.objective", registry.OBJECTIVES), ("algo.aggregation", registry.AGGREGATIONS),
        ("algo.filters[i]", registry.FILTERS), ("algo.correction", registry.CORRECTIONS), ("algo.loss", registry.LOSSES), ("data", registry.DATA_SOURCES),
    )
    for section, reg in sections:
        for entry in reg.entries():
            if entry.config is None:
                continue
            lines += ["", f"{section} with type: {entry.name} — {entry.doc}"]
            for name, tp, default, doc in describe(entry.config):
                if name != "type":
                    lines.append(f"  {section}.{name:22s} {doc}" + (f"  [{tp}; default {default}]" if tp != "section" else ""))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mmrl", description="Group-relative RL for generative policies.",
        epilog="Errors end with one line (bad input: exit 2; a simulator, wrapper or reward that raises: exit 1); MMRL_DEBUG=1 in the environment prints the traceback too.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    class _TrainHelp(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.print_help()
            print()
            print(_train_help())
            parser.exit(0)

    p = sub.add_parser("train", help="train from a YAML config", add_help=False, description="Train from a YAML config; dotted key=value overrides win over the file.")
    p.add_argument("-h", "--help", action=_TrainHelp, nargs=0, help="show this help and every config field")
    p.add_argument("config", help="YAML config, or a run directory with --resume")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.objective.eps_high=0.28")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    p.add_argument("--run-dir", help="output directory (default: run_dir from the config, else runs/<name>)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "train-reward", help="train a pairwise (Bradley-Terry) reward model on preference pairs", add_help=False,
        description="Train a pairwise reward model (policy.type bt_image, bt_image_set, bt_text or bt_trajectory; algo.type sft; data.type preferences) "
        "through the training loop; evaluation reports held-out pairwise accuracy. Write pairs with `python -m mmrl pairs`.",
    )
    p.add_argument("-h", "--help", action=_TrainHelp, nargs=0, help="show this help and every config field")
    p.add_argument("config", help="YAML config, or a run directory with --resume")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=0.001")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    p.add_argument("--run-dir", help="output directory (default: run_dir from the config, else runs/<name>)")
    p.set_defaults(func=cmd_train_reward)

    p = sub.add_parser("eval", help="evaluate a run directory or a config")
    p.add_argument("target", help="run directory (latest checkpoint), one checkpoint directory of a run, or YAML config (initial/pretrained weights)")
    p.add_argument("overrides", nargs="*", help="dotted overrides")
    p.add_argument("--episodes", type=_positive_int, default=None, help="episodes (default: eval.episodes of the config; with --suite: per task and seed)")
    p.add_argument("--suite", default=None, help="evaluate on a task suite: a name from configs/suites (e.g. tabletop_all) or a suite YAML")
    p.add_argument("--videos", type=_non_negative_int, default=None, help="with --suite: mp4 videos of the first N episodes of each task (default 1)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory instead of the latest")
    p.add_argument("--out", default=None, help="where to write eval tables (default: <run_dir>/eval)")
    p.add_argument("--save-episodes", default=None, metavar="DIR", help="write every evaluated episode to a new directory: a robot's (frames, actions, state, instruction, success, costs) in LeRobotDataset v3's layout, a language agent's turns as episodes.jsonl")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("list", help="list registered components, presets, task suites or tasks")
    p.add_argument("kind", choices=["envs", "policies", "rewards", "samplers", "presets", "suites", "tasks", "advantages", "objectives", "aggregations", "filters", "corrections", "losses", "kl", "engines", "data"])
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("doctor", help="check rendering backends, simulators and extras")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("collect", help="write scripted-expert demonstrations (tabletop tasks, or a run config's env)", description="Run scripted experts and write demonstrations (only successful episodes unless --keep-failures): of mmrl/Tabletop-v0 tasks (--task), or of a run config's env (--config; e.g. ManiSkill PushCube-v1), for SFT or an off-policy loss's demos.")
    p.add_argument("--task", nargs="+", default=None, help="task names, families (spatial, object, goal), all, or one suite (tabletop_spatial, ... or a suite YAML)")
    p.add_argument("--config", default=None, help="a run config: collect its env (env section and overrides) with that env's scripted expert")
    p.add_argument("overrides", nargs="*", help="with --config: dotted overrides of the run config (env.num_envs=1 ...)")
    p.add_argument("--out", required=True, help="output directory (index.json + one .npz per episode, or a LeRobotDataset v3 layout with --format lerobot)")
    p.add_argument("--format", choices=("mmrl-demos", "lerobot"), default="mmrl-demos", help="mmrl-demos (npz per episode, appendable) or lerobot (LeRobotDataset v3: parquet + lossless mp4 + meta)")
    p.add_argument("--episodes-per-task", type=_positive_int, default=None, help="episodes per task (default: the suite's, else 50; with --config: episodes, default 20)")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="episode j of each task resets with seed + j (must stay below 2**31, evaluation seeds)")
    p.add_argument("--env-id", default=None, help="env id (default: the suite's, else mmrl/Tabletop-v0, the only one with experts)")
    p.add_argument("--image-size", type=_positive_int, default=None, help="side of the observed images (default: the suite's, else 64)")
    p.add_argument("--obs-mode", choices=("rgb", "state"), default=None, help="what the episodes record: rgb (images, the pusher's state; the default) or state (the simulator's full state and a task one-hot, no images)")
    p.add_argument("--cameras", nargs="+", default=None, help="camera names (top, front); several give images [K, H, W, 3]")
    p.add_argument("--max-episode-steps", type=_positive_int, default=None, help="time limit of an episode (default: the suite's, else the env's 60)")
    p.add_argument("--noise", type=_non_negative_float, default=0.0, help="std of Gaussian noise added to the expert's actions (normalized units)")
    p.add_argument("--keep-failures", action="store_true", help="also write episodes the expert failed (success false)")
    p.add_argument("--append", action="store_true", help="add to an existing demonstrations directory")
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser(
        "serve-reward", help="serve the rewards of a run config over HTTP (for the remote reward)",
        description="Serve the rewards: of a run config over HTTP, combined as the run combines them (algo.reward_aggregation), "
        "for the remote reward of another run or any client of the protocol in docs/reward_models.md ('Rewards served over HTTP').",
    )
    p.add_argument("config", help="YAML config (its rewards: and algo.reward_aggregation), or a run directory")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. 'rewards=[{type: jpeg_compressibility}]'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=_non_negative_int, default=8000, help="port to listen on (default 8000; 0: a free port, printed)")
    p.add_argument("--quiet", action="store_true", help="no line per request on stderr")
    p.set_defaults(func=cmd_serve_reward)

    p = sub.add_parser(
        "export", help="write a trained policy in the layout its users' stack reads (mmrl export --help lists the formats)", add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write the policy of a run (its latest checkpoint), a checkpoint or a save_pretrained directory in the layout\n"
        "of the stack it came from. A wrong --format lists the ones this policy writes.",
    )
    p.add_argument("-h", "--help", action=_ExportHelp, help="show this help, with every format a policy writes, and exit")
    p.add_argument("source", help="run directory (latest checkpoint), checkpoint directory or save_pretrained directory")
    p.add_argument("--format", required=True, help="layout to write (the error for a wrong one lists this policy's)")
    p.add_argument("--out", required=True, help="new directory to write (must not exist, or be empty)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "pairs", help="write preference pairs for a pairwise reward model (mmrl pairs --help lists the sources)", add_help=False,
        description="Write verifier-labelled preference pairs (shapes, arithmetic, policy, episodes, merge).",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="a source and its options (mmrl pairs SOURCE --help)")
    p.set_defaults(func=cmd_pairs)

    p = sub.add_parser("plot", help="write PNG learning curves of a run")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output directory (default: <run_dir>/plots)")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # stdout went to a reader that stopped early (`mmrl train --help | head`): end quietly,
        # as a Unix tool killed by SIGPIPE does, with no traceback; the flush at exit would
        # raise again, so stdout is pointed at /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    # Options may come after the overrides (`mmrl train cfg.yaml a.b=1 --run-dir X`):
    # argparse stops filling a positional list at the first option, so dotted overrides
    # left over after the options are appended here; anything else is an error.
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["pairs"]:  # its own parser reads everything after the word, --help included
        args, rest = argparse.Namespace(func=cmd_pairs, args=argv[1:]), []
    else:
        args, rest = parser.parse_known_args(argv)
    if rest:
        if not hasattr(args, "overrides") or any(r.startswith("-") or "=" not in r for r in rest):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = [*args.overrides, *rest]
    try:
        return args.func(args)
    except (ConfigError, MissingExtraError) as e:
        _debug_traceback(e)
        print(f"mmrl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (NonFiniteError, RolloutWorkerError, UserCodeError) as e:
        _debug_traceback(e)
        kept = "; the last checkpoint is left intact" if args.func in (cmd_train, cmd_train_reward) else ""
        print(f"mmrl: stopped: {e}{kept}", file=sys.stderr)
        return 1


def _debug_traceback(error: BaseException) -> None:
    """With ``MMRL_DEBUG=1`` (any value but empty or 0): the traceback of an error the CLI
    otherwise shows as one line (chained causes included: a simulator's own exception behind
    a UserCodeError), and a rollout worker process's traceback."""
    if os.environ.get("MMRL_DEBUG", "") in ("", "0"):
        return
    traceback.print_exception(error, file=sys.stderr)
    remote = getattr(error, "remote_traceback", None)
    if remote:
        print(f"the rollout worker's traceback:\n{remote}", end="" if remote.endswith("\n") else "\n", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
