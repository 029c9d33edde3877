"""`mmrl export`: a trained policy written in the layout its users' stack reads, from a run,
a checkpoint or a save_pretrained directory; wrong input ends with one line and exit 2."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from mmrl.cli import main  # noqa: E402
from mmrl.core.weights import save_pretrained  # noqa: E402
from mmrl.train.checkpoint import Checkpointer  # noqa: E402
from tests.policies.test_image_diffusion_lora_export import LORA, _trained  # noqa: E402
from tests.policies.test_image_diffusion_models import SD_DENOISING, make as make_image, sd_pipeline  # noqa: E402
from tests.policies.test_vla_pretrained import _perturb, make as make_vla, vlm_dirs  # noqa: E402,F401


def _one_line(capsys) -> str:
    """The error line (loaders may draw progress bars on stderr before it)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mmrl: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_lora_image_policy_exports_the_adapters_diffusers_loads_from_a_run_directory(tmp_path, capsys):
    sd_pipeline(tmp_path / "base")
    policy = _trained(make_image(spec={}, model_path=str(tmp_path / "base"), denoising=SD_DENOISING, lora=LORA))
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad])
    checkpoint = Checkpointer(tmp_path / "run").save(3, policy, optimizer, {}, "name: x\n")
    (tmp_path / "run" / "config.yaml").write_text((checkpoint / "config.yaml").read_text())
    assert policy.export_formats().keys() <= type(policy).export_layouts.keys()  # what it writes as configured: of what its class declares
    assert main(["export", str(tmp_path / "run"), "--format", "diffusers-lora", "--out", str(tmp_path / "lora")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "lora")
    exported = load_file(tmp_path / "lora" / "pytorch_lora_weights.safetensors")
    beside = load_file(checkpoint / "lora_diffusers" / "pytorch_lora_weights.safetensors")
    assert exported.keys() == beside.keys() and all(torch.equal(exported[k], beside[k]) for k in exported)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".lora")]  # no temporary left

    assert main(["export", str(tmp_path / "run"), "--format", "lerobot", "--out", str(tmp_path / "x")]) == 2
    err = _one_line(capsys)
    assert "--format" in err and "lerobot" in err and "diffusers-lora" in err
    assert not (tmp_path / "x").exists()


def test_a_vla_on_a_pretrained_vlm_exports_the_vlm_and_a_miniature_says_it_has_no_format(vlm_dirs, tmp_path, capsys):
    import transformers

    policy = make_vla("flow_vla", vlm_dirs("paligemma"))
    _perturb(policy, scale=0.05)
    save_pretrained(policy, tmp_path / "trained")
    assert policy.export_formats().keys() <= type(policy).export_layouts.keys()
    assert main(["export", str(tmp_path / "trained"), "--format", "transformers", "--out", str(tmp_path / "vlm")]) == 0
    loaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "vlm").state_dict()
    trained = policy.backbone.vlm.state_dict()
    assert trained.keys() == loaded.keys() and all(torch.equal(trained[k], loaded[k]) for k in trained)

    miniature = make_vla("flow_vla", None, backbone={"vlm_path": None, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "vision_channels": [8, 16]})
    save_pretrained(miniature, tmp_path / "miniature")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "miniature"), "--format", "transformers", "--out", str(tmp_path / "y")]) == 2
    assert "writes: none" in _one_line(capsys)


def test_bad_sources_and_outputs_exit_2_with_one_line_and_a_failed_export_leaves_nothing(vlm_dirs, tmp_path, capsys, monkeypatch):
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), "--format", "transformers", "--out", str(tmp_path / "o")]) == 2
    assert "source" in _one_line(capsys)

    policy = make_vla("token_vla", vlm_dirs("paligemma"))
    save_pretrained(policy, tmp_path / "trained")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    assert main(["export", str(tmp_path / "trained"), "--format", "transformers", "--out", str(tmp_path / "busy")]) == 2
    assert "--out" in _one_line(capsys) and (tmp_path / "busy" / "keep.txt").read_text() == "mine"

    from mmrl.policies.token_vla.model import TokenVLAPolicy

    def fails_halfway(self, fmt, out):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(TokenVLAPolicy, "export", fails_halfway)
    with pytest.raises(OSError, match="disk full"):
        main(["export", str(tmp_path / "trained"), "--format", "transformers", "--out", str(tmp_path / "half")])
    assert not (tmp_path / "half").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".half")]


def test_export_help_lists_every_format_the_policies_declare_with_the_policies_that_write_it(capsys):
    from mmrl.core.policy import PolicyModule
    from mmrl.registry import POLICIES

    with pytest.raises(SystemExit) as e:
        main(["export", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    declared: dict[str, set[str]] = {}
    for entry in POLICIES.entries():
        writes = getattr(entry.obj, "export", None) is not getattr(PolicyModule, "export")
        assert bool(getattr(entry.obj, "export_layouts", {})) == writes, f"{entry.name}: a policy that exports declares its export_layouts"
        for name in getattr(entry.obj, "export_layouts", {}):
            declared.setdefault(name, set()).add(entry.name)
    listed: dict[str, set[str]] = {}  # format -> the policies its lines name
    for line in out.split("formats (--format)")[1].splitlines()[1:]:
        if line.startswith("    "):
            listed[name] |= set(line.strip().split(": ")[0].split(", "))
        else:
            name = line.strip()
            listed[name] = set()
    assert listed == declared and {"lerobot", "diffusers-lora", "transformers", "openvla", "openvla_oft"} <= set(listed)
    assert "    openvla_oft: the checkpoint's own layout" in out and "    pi0, pi05, smolvla: a LeRobot policy directory" in out
