"""The ``mmrl`` command: train, eval, list, doctor, plot.

Bad input (config keys, values, types, files, ids) ends with one line naming the field, the
value and what is allowed, and exit code 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from mmrl.errors import ConfigError, MissingExtraError, NonFiniteError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + message by default)
        self.exit(EXIT_USAGE, f"mmrl: error: {message} (see `{self.prog} --help`)\n")


def _config_and_dir(target: str, overrides: list[str]):
    """A config file, or a run directory holding config.yaml → (TrainConfig, run_dir|None)."""
    from mmrl.config import load_config
    from mmrl.train.config import TrainConfig

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


def cmd_eval(args) -> int:
    from mmrl.evaluate import evaluate_run

    cfg, run_dir = _config_and_dir(args.target, args.overrides)
    result = evaluate_run(cfg, run_dir, episodes=args.episodes, checkpoint=args.checkpoint, out_dir=args.out)
    print(json.dumps(result, indent=2))
    return 0


def cmd_list(args) -> int:
    from mmrl import registry
    from mmrl.config import list_presets

    kinds = {
        "envs": registry.ENVS,
        "policies": registry.POLICIES,
        "rewards": registry.REWARDS,
        "samplers": registry.SAMPLERS,
        "advantages": registry.ADVANTAGES,
        "objectives": registry.OBJECTIVES,
        "aggregations": registry.AGGREGATIONS,
        "filters": registry.FILTERS,
        "kl": registry.KL_ESTIMATORS,
    }
    if args.kind == "presets":
        for name in list_presets():
            print(name)
        return 0
    for entry in kinds[args.kind].entries():
        print(f"{entry.name:24s} {entry.doc}")
    if args.kind == "envs":
        import gymnasium

        ids = sorted(i for i in gymnasium.registry if i.startswith("mmrl/"))
        print("\ngymnasium ids shipped with mmrl (use with type: gym):")
        for i in ids:
            print(f"  {i}")
    return 0


def cmd_doctor(args) -> int:
    from mmrl.doctor import report

    return report()


def cmd_plot(args) -> int:
    from mmrl.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def _train_help() -> str:
    from mmrl import registry
    from mmrl.config import describe
    from mmrl.train.config import TrainConfig

    lines = ["fields (set in the YAML or as dotted overrides, e.g. algo.eps_high=0.28):", ""]
    for name, tp, default, doc in describe(TrainConfig):
        lines.append(f"  {name:28s} {doc}" + (f"  [{tp}; default {default}]" if tp != "section" else ""))
    for section, reg in (("env", registry.ENVS), ("policy", registry.POLICIES), ("sampler", registry.SAMPLERS), ("rewards[i]", registry.REWARDS)):
        for entry in reg.entries():
            if entry.config is None:
                continue
            lines += ["", f"{section} with type: {entry.name} — {entry.doc}"]
            for name, tp, default, doc in describe(entry.config):
                if name != "type":
                    lines.append(f"  {section}.{name:22s} {doc}  [{tp}; default {default}]")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mmrl", description="Group-relative RL for generative policies.")
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
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.eps_high=0.28")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    p.add_argument("--run-dir", help="output directory (default: run_dir from the config, else runs/<name>)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a run directory or a config")
    p.add_argument("target", help="run directory (latest checkpoint) or YAML config (initial/pretrained weights)")
    p.add_argument("overrides", nargs="*", help="dotted overrides")
    p.add_argument("--episodes", type=int, default=None, help="episodes (default: eval.episodes of the config)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory instead of the latest")
    p.add_argument("--out", default=None, help="where to write eval tables (default: <run_dir>/eval)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("list", help="list registered components or presets")
    p.add_argument("kind", choices=["envs", "policies", "rewards", "samplers", "presets", "advantages", "objectives", "aggregations", "filters", "kl"])
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("doctor", help="check rendering backends, simulators and extras")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("plot", help="write PNG learning curves of a run")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output directory (default: <run_dir>/plots)")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Options may come after the overrides (`mmrl train cfg.yaml a.b=1 --run-dir X`):
    # argparse stops filling a positional list at the first option, so dotted overrides
    # left over after the options are appended here; anything else is an error.
    args, rest = parser.parse_known_args(argv)
    if rest:
        if not hasattr(args, "overrides") or any(r.startswith("-") or "=" not in r for r in rest):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = [*args.overrides, *rest]
    try:
        return args.func(args)
    except (ConfigError, MissingExtraError) as e:
        print(f"mmrl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except NonFiniteError as e:
        print(f"mmrl: stopped: {e}; the last checkpoint is left intact", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
