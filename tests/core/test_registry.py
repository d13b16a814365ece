import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from core import registry


@pytest.fixture()
def model_name():
    return f"tiny-{uuid.uuid4().hex[:8]}"


def test_register_alias_resolve(local_stack, tiny_model_dir, model_name, tmp_path):
    import shutil

    from core import weights_manifest

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    (other / "generation_config.json").write_text('{"other": true}')
    with registry.start_run("rayline-test-registry", "register", tags=registry.lineage_tags("test")) as run:
        run_id = run.info.run_id
    v1 = registry.register_checkpoint(model_name, str(tiny_model_dir), run_id=run_id,
                                      tags={registry.TAG_DATASET_VERSION: "abc"})
    v2 = registry.register_checkpoint(model_name, str(other), run_id=run_id)
    assert (int(v1.version), int(v2.version)) == (1, 2)
    # Two checkpoints of one run: each uploaded under its own digest, neither overwriting the other.
    assert v1.source != v2.source and v1.source.endswith(v1.tags[registry.TAG_WEIGHTS_DIGEST][:16])
    assert v1.tags[registry.TAG_WEIGHTS_DIGEST] == weights_manifest.build(str(tiny_model_dir))["digest"]
    manifest = registry.registered_manifest(registry.client().get_model_version(model_name, v1.version))
    assert manifest["digest"] == v1.tags[registry.TAG_WEIGHTS_DIGEST] and "model.safetensors" in manifest["files"]
    assert registry.get_alias(model_name) is None

    registry.set_alias(model_name, registry.DEFAULT_ALIAS, v1.version)
    mv = registry.get_version(f"models:/{model_name}@champion")
    assert mv.version == v1.version and mv.tags[registry.TAG_DATASET_VERSION] == "abc"
    assert mv.tags[registry.TAG_CHECKPOINT_URI] == str(tiny_model_dir)
    # What resolves is the version's source, never the export path its tag names (an editable tag).
    registry.set_version_tags(model_name, v1.version, {registry.TAG_CHECKPOINT_URI: str(other)})
    path = registry.resolve_model_uri(f"models:/{model_name}@champion", cache_dir=tmp_path / "cache")
    assert (tmp_path / "cache").as_posix() in path
    assert weights_manifest.build(path)["digest"] == v1.tags[registry.TAG_WEIGHTS_DIGEST]

    registry.set_alias(model_name, registry.DEFAULT_ALIAS, v2.version)
    assert registry.get_alias(model_name).version == v2.version


def test_local_checkpoint_is_downloadable_from_mlflow(local_stack, tiny_model_dir, model_name, tmp_path):
    with registry.start_run("rayline-test-registry", "download") as run:
        mv = registry.register_checkpoint(model_name, str(tiny_model_dir), run_id=run.info.run_id)
    moved = tmp_path / "moved"
    tiny_model_dir.rename(moved)
    try:
        path = registry.resolve_model_uri(f"models:/{model_name}/{mv.version}", cache_dir=tmp_path / "cache")
    finally:
        moved.rename(tiny_model_dir)
    assert (tmp_path / "cache").as_posix() in path
    assert (tiny_model_dir / "model.safetensors").read_bytes() == (path and open(f"{path}/model.safetensors", "rb").read())


def test_bad_references_are_named(local_stack, model_name):
    with pytest.raises(ValueError, match="expected models:/NAME/VERSION"):
        registry.parse_model_ref("models:/just-a-name")
    with pytest.raises(LookupError, match=f"models:/{model_name}@champion: not found"):
        registry.get_version(f"models:/{model_name}@champion")


def test_resume_continues_the_same_run(local_stack):
    name = f"resume-{uuid.uuid4().hex[:6]}"
    with registry.start_run("rayline-test-registry", name) as first:
        pass
    with registry.start_run("rayline-test-registry", name, resume=True) as second:
        pass
    assert first.info.run_id == second.info.run_id


def test_ray_job_id_comes_from_the_job_supervisors_metadata(monkeypatch):
    import json

    monkeypatch.delenv("RAY_JOB_SUBMISSION_ID", raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert registry.ray_job_id() is None
    # What Ray 2.60's job supervisor sets in the entrypoint's environment.
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {}, "metadata": {
        "job_submission_id": "raysubmit_abc", "job_name": "raysubmit_abc"}}))
    assert registry.ray_job_id() == "raysubmit_abc"
    assert registry.lineage_tags("data")[registry.TAG_RAY_JOB_ID] == "raysubmit_abc"
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{not json")
    assert registry.ray_job_id() is None


def test_stage_code_imports_the_registry_without_mlflow():
    # Engine actors and train workers import these for names and paths; mlflow (~0.8 s) only where it is called.
    code = "import sys, core.registry, serve.online.engine, serve.batch.pipeline; print(sorted(m for m in sys.modules if m.startswith('mlflow')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_a_copied_version_is_its_origins_bytes(local_stack, tiny_model_dir, model_name, tmp_path):
    """A version copied into another registered model (the MLflow UI's "Promote model") resolves to, and is checked
    against, the version it was copied from."""
    from serve.online.engine import resolve_checkpoint

    with registry.start_run("rayline-test-registry", "copy") as run:
        mv = registry.register_checkpoint(model_name, str(tiny_model_dir), run_id=run.info.run_id)
    copy = registry.client().copy_model_version(f"models:/{model_name}/{mv.version}", f"{model_name}-prod")
    assert registry.origin_version(copy).name == model_name
    path, info = resolve_checkpoint(f"models:/{model_name}-prod/{copy.version}", tmp_path / "cache")
    assert info.digest == mv.tags[registry.TAG_WEIGHTS_DIGEST] and (Path(path) / "config.json").is_file()


def test_bytes_changed_after_registration_are_refused_by_name(local_stack, tiny_model_dir, model_name, tmp_path):
    """A weight file changed in the served copy after registration: the loader refuses it, naming the file."""
    from core.weights_manifest import ManifestMismatch
    from serve.online.engine import resolve_checkpoint

    with registry.start_run("rayline-test-registry", "tamper") as run:
        mv = registry.register_checkpoint(model_name, str(tiny_model_dir), run_id=run.info.run_id)
    path, _ = resolve_checkpoint(f"models:/{model_name}/{mv.version}", tmp_path / "cache")
    weights = Path(path) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestMismatch, match=r"model.safetensors: changed since registration"):
        resolve_checkpoint(f"models:/{model_name}/{mv.version}", tmp_path / "cache")
    # The bad copy is gone with the refusal: the next resolve fetches the registered bytes again, and they pass.
    assert not Path(path).exists()
    assert resolve_checkpoint(f"models:/{model_name}/{mv.version}", tmp_path / "cache")[1].digest == \
        mv.tags[registry.TAG_WEIGHTS_DIGEST]
