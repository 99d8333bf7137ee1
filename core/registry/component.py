"""One provided part (a communicator, executor or model runner), as a plugin declares it."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardline.errors import BackendUnavailableError
from shardline.interfaces.capabilities import Capabilities
from shardline.interfaces.communicator_backend import CommunicatorBackend
from shardline.interfaces.executor import Executor
from shardline.interfaces.model_runner import ModelRunner

#: What a component's target must be a subclass of, by kind.
KIND_BASES: dict[str, type] = {
    "communicator": CommunicatorBackend,
    "executor": Executor,
    "model_runner": ModelRunner,
}


@dataclass(frozen=True)
class Component:
    """A named part a plugin provides.

    - ``name``: what a config file writes to select it (``communicator: gloo``).
    - ``target``: ``"package.module:Attribute"``, imported only when the part is used.
    - ``summary``: one line for ``shardline plugins``.
    - ``capabilities``: for communicators, what the backend supports (checked at validation).
    - ``capabilities_of``: for a communicator that wraps another registered one (its
      name): the registry gives it that one's capabilities, instead of ``capabilities``.
    - ``auto_preference``: for communicators, how strongly ``communicator: auto`` prefers it
      among those that fit (higher first; the fastest should declare the highest).
    - ``prestart``: for executors, ``"package.module:function"`` that an engine calls with
      its config before checking it, where this executor is the one configured (or ``auto``
      picks): a head start on the ranks' start-up (the ``mp`` executor's fork server imports
      the ranks' modules meanwhile). Its module must import quickly (no torch); what it
      starts must not outlive an unused start by long. It may return a function of no
      arguments that undoes the head start, which the engine calls where the check then
      refuses the config (``mp``'s ends its fork server at once), or None.
    - ``kind`` and ``plugin`` are filled in by the registry.
    """

    name: str
    target: str
    summary: str = ""
    capabilities: Capabilities | None = None
    capabilities_of: str = ""
    auto_preference: int = 0
    prestart: str = ""
    kind: str = ""
    plugin: str = ""

    def load(self) -> Any:
        """The class ``target`` names. Raises ImportError or AttributeError if it is missing,
        TypeError if it is not a subclass of what its kind needs (:data:`KIND_BASES`)."""
        loaded = import_target(self.target)
        check_kind(loaded, self.kind, self.target)
        return loaded

    def load_available(self) -> Any:
        """Like :meth:`load`, but raises :class:`BackendUnavailableError` with the reason when
        this part cannot run here."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(
                f"{self.kind or 'component'} {self.name!r} cannot run here: {reason}"
            )
        return self.load()

    def unavailable_reason(self) -> str | None:
        """Why this part cannot run here, or None. Import failures count as a reason."""
        try:
            loaded = import_target(self.target)
        except Exception as error:
            return f"cannot import {self.target}: {type(error).__name__}: {error}"
        try:
            check_kind(loaded, self.kind, self.target)
        except TypeError as error:
            return str(error)
        check = getattr(loaded, "unavailable_reason", None)
        return check() if callable(check) else None

    def head_start(self, config: Any) -> Callable[[], None] | None:
        """Call this executor's ``prestart`` hook with ``config``; what it returned (the undo,
        or None), or None where it declares none."""
        if not self.prestart:
            return None
        return import_target(self.prestart)(config)

    def claimed_by(self, kind: str, plugin: str) -> Component:
        return dataclasses.replace(self, kind=kind, plugin=plugin)


def check_kind(loaded: Any, kind: str, target: str) -> None:
    """Raise TypeError unless ``loaded`` is a subclass of ``kind``'s base class (nothing is
    called: a wrong target such as ``os:system`` is refused before it can run)."""
    base = KIND_BASES.get(kind)
    if base is None or (isinstance(loaded, type) and issubclass(loaded, base)):
        return
    what = f"class {loaded.__qualname__}" if isinstance(loaded, type) else type(loaded).__name__
    raise TypeError(
        f"{target} is a {what}, not a subclass of {base.__module__}.{base.__qualname__}"
    )


def import_target(target: str) -> Any:
    """Import ``"package.module:Attribute"`` (dots allowed after the colon)."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"expected 'package.module:Attribute', got {target!r}")
    loaded: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        loaded = getattr(loaded, part)
    return loaded
