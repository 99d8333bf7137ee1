"""``shardline conformance NAME``: the pytest-based suite on one communicator or executor."""

from __future__ import annotations

import argparse
import os
import signal
import types

import pytest

from shardline.cli.flags import check_seconds
from shardline.config.capacity import checked_world_sizes
from shardline.errors import ConfigError
from shardline.interfaces import CommunicatorBackend, Executor
from shardline.registry import Registry

_BASES = {"communicator": CommunicatorBackend, "executor": Executor}


def suite_kind(name: str, registry: Registry) -> str:
    """Which suite checks ``name``: the kind of the registered component (or of the class a
    ``package.module:Class`` names). ConfigError when it is none, or both."""
    kinds = []
    for kind, base in _BASES.items():
        if ":" in name:
            try:
                target = registry.get(kind, name).load()
            except ConfigError:
                continue
            if isinstance(target, type) and issubclass(target, base):
                kinds.append(kind)
        elif name in {component.name for component in registry.components(kind)}:
            kinds.append(kind)
    if len(kinds) == 1:
        return kinds[0]
    if kinds:
        raise ConfigError(
            f"conformance NAME = {name!r} is both a communicator and an executor; "
            "allowed: pass --kind communicator or --kind executor"
        )
    installed = sorted(component.name for kind in _BASES for component in registry.components(kind))
    raise ConfigError(
        f"conformance NAME = {name!r} is no installed communicator or executor; allowed: "
        f"{', '.join(installed)}, or package.module:Class"
    )


def run(args: argparse.Namespace, extra: list[str]) -> int:
    allow = os.environ.get("SHARDLINE_PLUGINS")
    registry = Registry.load(allow=tuple(allow.split(",")) if allow else None)
    kind = args.kind or suite_kind(args.name, registry)
    if args.timeout is not None:
        check_seconds("--timeout", args.timeout)
    if args.world_sizes is not None:
        checked_world_sizes("--world-sizes", args.world_sizes)
    if kind == "communicator":
        options = [
            "--pyargs",
            "shardline.conformance",
            f"--shardline-communicator={args.name}",
            f"--shardline-world-sizes={args.world_sizes or '1,2,3,4'}",
            f"--shardline-timeout={args.timeout or 30.0}",
        ]
        if args.report:
            options.append(f"--shardline-report={args.report}")
    else:
        options = [
            "--pyargs",
            "shardline.conformance.executors",
            f"--shardline-executor={args.name}",
            f"--shardline-executor-world-sizes={args.world_sizes or '1,2,4'}",
            f"--shardline-executor-timeout={args.timeout or 20.0}",
            f"--shardline-launcher={args.launcher}",
        ]
        if args.report:
            options.append(f"--shardline-executor-report={args.report}")
    common = [
        "-p",
        "no:cacheprovider",
        "-q",
        # The CLI has imported shardline already, so pytest cannot rewrite its asserts; the
        # suites' checks raise their own messages and do not need it.
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
    ]
    return _run_pytest(options + common + extra)


class _SuiteTerminated(KeyboardInterrupt):
    """SIGTERM during the suite: pytest stops as on Ctrl-C, tearing down the worlds it
    started (another exception would only fail the test running and go on to the next)."""


class _InterruptTracebacks:
    """A pytest plugin for the interrupt a signal handler raised (Ctrl-C, SIGTERM): its
    traceback loses the entries that have no line number before pytest formats it.

    Python gives an entry no line number when the handler ran at an instruction that has
    none (a ``with`` block's exit on its exception path, say); pytest's formatting of such
    an entry raised TypeError, which escaped ``pytest.main`` as an internal error instead of
    the stop, and the report was written as complete."""

    @pytest.hookimpl(wrapper=True)
    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo) -> object:
        entries = list(_entries(excinfo.tb))
        if any(entry.tb_lineno is None for entry in entries):
            kept = None
            for entry in reversed(entries):
                if entry.tb_lineno is not None:
                    kept = types.TracebackType(
                        kept, entry.tb_frame, entry.tb_lasti, entry.tb_lineno
                    )
            lined = pytest.ExceptionInfo.from_exc_info((excinfo.type, excinfo.value, kept))
            excinfo.traceback = lined.traceback
        return (yield)


def _entries(traceback: types.TracebackType | None):
    """The entries of ``traceback``, outermost first."""
    while traceback is not None:
        yield traceback
        traceback = traceback.tb_next


def _run_pytest(arguments: list[str]) -> int:
    """``pytest.main(arguments)``; SIGTERM stops it (see :class:`_SuiteTerminated`) and then
    ends the command as SIGTERM ends any other (``Terminated``: exit code 143)."""
    from shardline.cli.main import StopOnSigterm, Terminated

    on_sigterm = StopOnSigterm(_SuiteTerminated)
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        code = int(pytest.main(arguments, plugins=[_InterruptTracebacks()]))
    finally:
        if on_sigterm.first is None:
            signal.signal(signal.SIGTERM, previous)
    if on_sigterm.first is not None:
        raise Terminated
    return code
