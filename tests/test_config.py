from dataclasses import dataclass

import pytest

from mmrl.config import apply_overrides, describe, from_dict, load_config, option, to_dict
from mmrl.errors import ConfigError
from mmrl.train.run_config import AlgoConfig, TrainConfig
from tests.conftest import ROOT, point_reach_config


@dataclass
class _Inner:
    lr: float = option(0.1, "learning rate", gt=0)
    mode: str = option("a", "a mode", choices=["a", "b"])


@dataclass
class _Outer:
    steps: int = option(1, "steps", ge=0)
    inner: _Inner = option(factory=_Inner, doc="inner section")
    tags: list[str] = option(factory=list, doc="tags")


def test_nested_dataclass_from_yaml_values():
    cfg = from_dict(_Outer, {"steps": 3, "inner": {"lr": "1e-3", "mode": "b"}, "tags": ["x"]})
    assert cfg.steps == 3 and cfg.inner.lr == 1e-3 and cfg.inner.mode == "b" and cfg.tags == ["x"]


@dataclass
class _OwnDefaults:
    inner: _Inner = option(factory=lambda: _Inner(lr=0.5, mode="b"), doc="inner section with this parent's defaults")


def test_a_nested_section_keeps_its_fields_own_defaults_for_the_keys_a_file_leaves_out():
    assert from_dict(_OwnDefaults, {"inner": {"lr": 0.2}}).inner == _Inner(lr=0.2, mode="b")
    assert from_dict(_OwnDefaults, {}).inner == _Inner(lr=0.5, mode="b")
    rows = {name: default for name, _, default, _ in describe(_OwnDefaults)}
    assert rows["inner.lr"] == "0.5" and rows["inner.mode"] == "'b'"


@pytest.mark.parametrize(
    "data, field, allowed",
    [
        ({"stepz": 1}, "stepz", "unknown key"),
        ({"steps": "many"}, "steps", "expected an integer"),
        ({"steps": True}, "steps", "expected an integer"),
        ({"steps": -1}, "steps", "must be >= 0"),
        ({"inner": {"lr": 0}}, "inner.lr", "must be > 0"),
        ({"inner": {"mode": "c"}}, "inner.mode", "allowed: a, b"),
        ({"inner": 3}, "inner", "expected a mapping"),
        ({"tags": "x"}, "tags", "expected a list"),
    ],
)
def test_bad_values_name_field_value_and_allowed(data, field, allowed):
    with pytest.raises(ConfigError) as e:
        from_dict(_Outer, data)
    assert e.value.field == field
    assert allowed in str(e.value)
    assert "\n" not in str(e.value)


MOVED_ALGO_KEYS = sorted(AlgoConfig.moved_keys.items())


def _algo_setting(to: str, section_type: str | None, **options) -> dict:
    """The algo section that holds ``options`` at the dotted place ``to`` (``filters[i].lo``:
    one list item), its innermost section of ``section_type``."""
    *sections, _ = to.split(".")
    node = {**({"type": section_type} if section_type else {}), **options}
    for name in reversed(sections):
        node = {name.removesuffix("[i]"): [node] if name.endswith("[i]") else node}
    return node


def _value_at(algo: dict, to: str):
    for name in to.split("."):
        algo = algo[name.removesuffix("[i]")]
        if name.endswith("[i]"):
            algo = algo[0]
    return algo


@pytest.mark.parametrize("old, moved", MOVED_ALGO_KEYS, ids=[old for old, _ in MOVED_ALGO_KEYS])
def test_a_moved_algo_key_names_its_new_place_from_a_file_and_an_override(write_config, old, moved):
    place = f"moved to algo.{moved.to}"
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, write_config(point_reach_config(algo={"group_size": 4, old: 1})))
    assert e.value.field == f"algo.{old}" and place in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, write_config(point_reach_config()), [f"algo.{old}=1"])
    assert e.value.field == f"algo.{old}" and place in str(e.value)


@pytest.mark.parametrize("old, moved", MOVED_ALGO_KEYS, ids=[old for old, _ in MOVED_ALGO_KEYS])
def test_the_new_place_of_a_moved_algo_key_is_a_key_that_loads(old, moved):
    key = moved.to.rsplit(".", 1)[-1]
    default = _value_at(to_dict(from_dict(TrainConfig, point_reach_config(algo=_algo_setting(moved.to, moved.section_type))).algo), moved.to)
    cfg = from_dict(TrainConfig, point_reach_config(algo=_algo_setting(moved.to, moved.section_type, **{key: default})))
    assert _value_at(to_dict(cfg.algo), moved.to) == default


def test_dotted_overrides_win_and_parse_types():
    data = apply_overrides({"algo": {"objective": {"eps_high": 0.2}}}, ["algo.objective.eps_high=0.28", "algo.filters=[zero_variance]", "seed=3"])
    assert data == {"algo": {"objective": {"eps_high": 0.28}, "filters": ["zero_variance"]}, "seed": 3}


def test_preset_defaults_are_merged_under_the_file(write_config):
    path = write_config({"defaults": "presets/dapo", **point_reach_config(algo={"objective": {"eps_high": 0.3}, "group_size": 4})})
    cfg = load_config(TrainConfig, path, ["algo.objective.eps_low=0.1"])
    assert [f.type for f in cfg.algo.filters] == ["zero_variance"]  # from the preset
    assert cfg.algo.objective.type == "ppo_clip"  # the file's section without a type keeps the preset's
    assert cfg.algo.objective.eps_high == 0.3  # the file wins over the preset
    assert cfg.algo.objective.eps_low == 0.1  # the command line wins over both


def test_a_section_of_another_type_takes_that_methods_own_defaults(write_config):
    """`objective: cispo` on top of a ppo_clip preset must not inherit PPO's 0.2 clip: CISPO's
    cap is 5.0 and one-sided (the bug of a flat algo config)."""
    cfg = load_config(TrainConfig, write_config({"defaults": "presets/dapo", **point_reach_config()}), ["algo.objective=cispo"])
    assert type(cfg.algo.objective).__name__ == "CISPOConfig"
    assert cfg.algo.objective.eps_high == 5.0 and cfg.algo.objective.eps_low is None
    cfg = load_config(TrainConfig, write_config({"defaults": "presets/grpo", **point_reach_config()}), ["algo.objective.type=gspo"])
    assert (cfg.algo.objective.eps_low, cfg.algo.objective.eps_high) == (3e-4, 4e-4)


def test_every_registered_axis_config_has_its_functions_defaults():
    """Each method's config dataclass gives the same defaults as its function's signature,
    so a config never silently changes a method."""
    import inspect
    from dataclasses import fields

    from mmrl import registry

    for reg in (registry.ADVANTAGES, registry.OBJECTIVES, registry.AGGREGATIONS, registry.FILTERS):
        for entry in reg.entries():
            params = inspect.signature(entry.obj).parameters
            for f in fields(entry.config):
                if f.name in params:
                    assert params[f.name].default == getattr(entry.config(), f.name), (reg.kind, entry.name, f.name)


def test_type_selects_the_registered_component_config(write_config):
    cfg = load_config(TrainConfig, write_config(point_reach_config()))
    assert type(cfg.policy).__name__ == "GaussianMLPConfig"
    assert cfg.policy.hidden_sizes == [16, 16]
    assert [type(r).__name__ for r in cfg.rewards] != ["RewardConfig", "RewardConfig"]


def test_unknown_type_lists_known_names(write_config):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, write_config(point_reach_config(policy={"type": "nope"})))
    assert e.value.field == "policy.type" and "gaussian_mlp" in str(e.value)


def test_unknown_registry_option_in_algo_lists_known_names(write_config):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, write_config(point_reach_config()), ["algo.objective=ppo2"])
    assert e.value.field == "algo.objective.type" and "ppo_clip" in str(e.value)


def test_every_field_has_a_doc():
    missing = [name for name, tp, _, doc in describe(TrainConfig) if not doc]
    assert not missing


def test_every_shipped_config_and_preset_loads():
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert len(paths) >= 4
    for path in paths:
        load_config(TrainConfig, path)
    for preset in sorted((ROOT / "configs" / "presets").glob("*.yaml")):
        load_config(TrainConfig, ROOT / "configs" / "point_reach_grpo.yaml", [f"defaults=presets/{preset.stem}", "algo.group_size=5"])


def test_a_group_relative_advantage_declares_the_group_it_needs_where_it_registers():
    from mmrl.registry import ADVANTAGES, for_section

    needs_group = {e.name for e in ADVANTAGES.entries() if e.traits.get("min_group_size", 1) > 1}
    assert {"grpo", "rloo", "median"} <= needs_group and "passk" not in needs_group
    for name in sorted(needs_group):
        with pytest.raises(ConfigError, match="algo.group_size: got 1; must be >= 2"):
            from_dict(TrainConfig, point_reach_config(algo={"group_size": 1, "advantage": {"type": name}}))
    # the section a registry fills is declared with it: the config engine asks the registry
    assert for_section("policy") is not None and for_section("advantage") is ADVANTAGES and for_section("no_such_section") is None
