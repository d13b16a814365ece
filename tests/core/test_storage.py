import pytest

from core import storage


def _make_tree(root):
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_text("alpha")
    (root / "sub" / "b.bin").write_bytes(bytes(range(256)) * 100)
    (root / "sub" / "deeper" / "c.json").write_text('{"c": 1}')
    return {"a.txt", "sub/b.bin", "sub/deeper/c.json"}


def _roundtrip(src, remote_uri, back):
    files = _make_tree(src)
    storage.copy_tree(str(src), remote_uri)
    assert set(storage.list_files(remote_uri)) == files
    assert storage.read_text(storage.join(remote_uri, "sub/deeper/c.json")) == '{"c": 1}'
    storage.copy_tree(remote_uri, str(back))
    for f in files:
        assert (back / f).read_bytes() == (src / f).read_bytes()
    storage.delete_tree(remote_uri)
    assert not storage.exists(storage.join(remote_uri, "a.txt"))


def test_local_roundtrip(tmp_path):
    _roundtrip(tmp_path / "src", f"file://{tmp_path}/dst", tmp_path / "back")


def test_s3_roundtrip(tmp_path, s3_bucket):
    _roundtrip(tmp_path / "src", f"{s3_bucket}/storage-test/{tmp_path.name}", tmp_path / "back")


def test_resolve_strips_scheme_for_ray(s3_bucket):
    fs, path = storage.resolve(f"{s3_bucket}/runs/x/")
    assert path == f"{s3_bucket[5:]}/runs/x" and fs.type_name == "s3"


def test_unknown_scheme_is_named():
    with pytest.raises(ValueError, match="gs://b/x: unsupported storage scheme"):
        storage.resolve("gs://b/x")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        storage.read_text(str(tmp_path / "nope.txt"))


def test_a_keyless_s3_filesystem_pickles_without_the_keys(monkeypatch):
    """What goes into a Ray task (a pickled filesystem) carries the endpoint but not the keys with keys=False;
    the default filesystem, used in the process that builds it, has them."""
    import pickle

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key-id-for-the-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-for-the-test")
    keyless = pickle.dumps(storage.s3_filesystem(keys=False))
    assert b"127.0.0.1:9000" in keyless
    assert b"key-id-for-the-test" not in keyless and b"secret-for-the-test" not in keyless
    assert b"secret-for-the-test" in pickle.dumps(storage.s3_filesystem())  # the check can fail: keys do pickle
