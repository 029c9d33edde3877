"""Pretrained sources by hub id (mmrl.hub), all offline: a cache the test lays out as
huggingface_hub does, and a stand-in hub on 127.0.0.1 (tests/hub_server.py) for the download
path, revisions included."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from mmrl import hub
from mmrl.config import from_dict
from mmrl.core.weights import build_policy
from mmrl.errors import ConfigError
from tests.hub_server import FakeHub

pytest.importorskip("huggingface_hub")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache for this test, online against no endpoint until one is set."""
    from huggingface_hub import constants

    root = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    return root


def lay_out(cache_root, repo_id: str, revisions: dict[str, dict[str, bytes]]) -> dict[str, str]:
    """Write ``repo_id`` into the cache as huggingface_hub lays it out: blobs by hash,
    ``snapshots/<commit>/`` pointing at them, ``refs/<revision>`` naming the commit."""
    repo = cache_root / f"models--{repo_id.replace('/', '--')}"
    shas = {}
    for revision, files in revisions.items():
        sha = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
        shas[revision] = sha
        for name, data in files.items():
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = repo / "snapshots" / sha / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / revision).write_text(sha)
    return shas


def test_hub_ids_are_told_from_paths():
    assert hub.split_hub_id("lerobot/smolvla_base") == ("lerobot/smolvla_base", None)
    assert hub.split_hub_id("HuggingFaceTB/SmolLM2-135M@v1.0") == ("HuggingFaceTB/SmolLM2-135M", "v1.0")
    assert hub.split_hub_id("org/name@refs/pr/3") == ("org/name", "refs/pr/3")
    for path in ("/abs/dir", "./rel", "runs/a/b", "../up", "~/x", ""):
        assert hub.split_hub_id(path) is None, path


def test_a_cached_hub_id_resolves_offline_at_its_revision(cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    shas = lay_out(cache, "org/tiny", {"main": {"config.json": b'{"v": 1}'}, "v1": {"config.json": b'{"v": 2}'}})
    main = hub.pretrained_dir("org/tiny", "policy.model_path")
    assert main == cache / "models--org--tiny" / "snapshots" / shas["main"]
    assert json.loads((main / "config.json").read_text()) == {"v": 1}
    assert json.loads((hub.pretrained_dir("org/tiny@v1", "policy.model_path") / "config.json").read_text()) == {"v": 2}
    assert json.loads((hub.pretrained_dir("org/tiny", "f", revision="v1") / "config.json").read_text()) == {"v": 2}


def test_a_miss_is_one_line_with_the_id_the_revision_and_where_it_looked(cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as e:
        hub.pretrained_dir("org/absent@v3", "policy.model_path")
    message = str(e.value)
    assert "\n" not in message and message.startswith("policy.model_path: got 'org/absent@v3'")
    assert "'org/absent'" in message and "'v3'" in message and str(cache) in message and "HF_HUB_OFFLINE=1" in message
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with FakeHub({}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        with pytest.raises(ConfigError) as e:
            hub.pretrained_dir("org/absent", "policy.model_path")
    assert "\n" not in str(e.value) and server.url in str(e.value) and "'main'" in str(e.value)
    with pytest.raises(ConfigError, match="no such directory, and not a hub id"):
        hub.pretrained_dir("runs/a/missing", "policy.model_path")


def test_a_local_directory_of_that_name_wins(cache, tmp_path, monkeypatch):
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with FakeHub({"org/tiny": {"main": tmp_path}}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        assert hub.pretrained_dir("org/tiny", "f").resolve() == local.resolve()
    assert server.requests == []  # nothing was asked of the hub


def _save_lm(directory, seed: int):
    import transformers

    from mmrl.policies.tiny_tokenizers import byte_tokenizer

    tokenizer = byte_tokenizer()
    config = transformers.AutoConfig.for_model(
        "qwen2", hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
        vocab_size=len(tokenizer), tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    torch.save({"w": torch.zeros(1)}, directory / "pytorch_model.bin")  # a pickled copy mmrl never fetches
    return model


def test_a_text_lm_by_hub_id_downloads_its_revision_and_then_loads_from_the_cache(cache, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from mmrl.policies.text_lm.config import TextLMConfig

    main, v1 = _save_lm(tmp_path / "main", 1), _save_lm(tmp_path / "v1", 2)
    ids = torch.tensor([[5, 17, 42, 7]])

    def logits(model_path):
        policy = build_policy(from_dict(TextLMConfig, {"type": "text_lm", "model_path": model_path}, "policy"), {})
        with torch.no_grad():
            return policy.language_model(input_ids=ids).logits

    with FakeHub({"org/tiny-lm": {"main": tmp_path / "main", "v1": tmp_path / "v1"}}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        with torch.no_grad():
            assert torch.equal(logits("org/tiny-lm@v1"), v1(input_ids=ids).logits)
            assert torch.equal(logits("org/tiny-lm"), main(input_ids=ids).logits)
    assert any(r.startswith("GET /api/models/org/tiny-lm/revision/v1") for r in server.requests)
    assert not any(r.endswith("pytorch_model.bin") for r in server.requests)
    snapshots = list((cache / "models--org--tiny-lm" / "snapshots").iterdir())
    assert len(snapshots) == 2 and not any((s / "pytorch_model.bin").exists() for s in snapshots)
    # the server is gone: offline, both revisions load from the cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with torch.no_grad():
        assert torch.equal(logits("org/tiny-lm@v1"), v1(input_ids=ids).logits)


def test_a_download_that_stops_midway_leaves_the_cache_usable(cache, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text('{"v": 1}')
    (repo / "model.safetensors").write_bytes(os.urandom(200_000))
    with FakeHub({"org/big": {"main": repo}}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        server.drop_over = 1000  # the weights' connection drops half-way, every time
        with pytest.raises(ConfigError) as e:
            hub.pretrained_dir("org/big", "policy.model_path")
        assert "\n" not in str(e.value) and "'org/big'" in str(e.value) and "could not be fetched" in str(e.value)
        # no snapshot holds a partial file (a blob lands under its name only when complete)
        snapshot_files = [p for p in (cache / "models--org--big").rglob("*") if "snapshots" in p.parts and p.is_file()]
        assert [p.name for p in snapshot_files] in ([], ["config.json"])
        server.drop_over = None
        path = hub.pretrained_dir("org/big", "policy.model_path")
        assert any(r.startswith("GET /org/big/resolve/") and r.endswith("model.safetensors") for r in server.requests)
    assert (path / "model.safetensors").read_bytes() == (repo / "model.safetensors").read_bytes()


def test_a_diffusers_pipeline_by_hub_id_fetches_only_its_components(cache, tmp_path, monkeypatch):
    repo = tmp_path / "pipe"
    (repo / "unet").mkdir(parents=True)
    (repo / "scheduler").mkdir()
    (repo / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline", "unet": ["diffusers", "UNet2DModel"], "scheduler": ["diffusers", "DDPMScheduler"], "safety_checker": [None, None]}))
    (repo / "unet" / "config.json").write_text("{}")
    (repo / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"u")
    (repo / "scheduler" / "scheduler_config.json").write_text("{}")
    (repo / "single_file.safetensors").write_bytes(b"s" * 100)  # a single-file checkpoint beside the pipeline
    with FakeHub({"org/pipe": {"main": repo}}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        path = hub.pipeline_dir("org/pipe", "policy.model_path")
    got = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert got == ["model_index.json", "scheduler/scheduler_config.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors"]


def test_a_lerobot_checkpoints_vlm_name_fetches_its_config_and_tokenizer_not_its_weights(cache, tmp_path, monkeypatch):
    from mmrl.policies.vla.lerobot_format import resolve_vlm

    repo = tmp_path / "vlm"
    repo.mkdir()
    (repo / "config.json").write_text("{}")
    (repo / "tokenizer_config.json").write_text("{}")
    (repo / "model.safetensors").write_bytes(b"w" * 1000)
    with FakeHub({"Org/SmolVLM-tiny": {"main": repo}}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        path = resolve_vlm("Org/SmolVLM-tiny", None)
    assert (path / "config.json").is_file() and not (path / "model.safetensors").exists()
    with pytest.raises(ConfigError, match=r"policy\.vlm_dir: .*'Org/Absent'"):
        resolve_vlm("Org/Absent", None)


def test_doctor_reports_the_cache_and_offline_mode(cache, monkeypatch):
    from huggingface_hub import constants

    from mmrl.commands.doctor import hub_row

    name, status, detail = hub_row()
    assert (name, status) == ("hub", "ok") and str(cache) in detail and "online" in detail
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE=1" in hub_row()[2]
