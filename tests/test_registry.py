"""The plugin registry over real entry points (dist-info folders on sys.path)."""

import pytest

from shardline.errors import BackendUnavailableError, ConfigError, PluginError
from shardline.registry import Registry
from support.fake_plugins import COMMUNICATOR_PLUGIN, install_plugin


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_builtin_gloo_is_registered_through_its_entry_point():
    registry = Registry.load()
    component = registry.get("communicator", "gloo")
    assert component.plugin == "gloo"
    assert component.target == "shardline_gloo.communicator:GlooBackend"
    assert component.unavailable_reason() is None
    assert "sum" in component.capabilities.reduce_ops


def test_plugin_that_raises_on_import_is_reported_and_others_load(plugin_dir):
    install_plugin(
        plugin_dir, "broken-dist", "broken", "broken_plugin", "raise RuntimeError('no driver here')"
    )
    install_plugin(
        plugin_dir, "fine-dist", "fine", "fine_plugin", COMMUNICATOR_PLUGIN.format(name="fine")
    )
    registry = Registry.load()
    assert [f.name for f in registry.failures] == ["broken"]
    assert "RuntimeError: no driver here" in registry.failures[0].error
    assert registry.get("communicator", "fine").plugin == "fine"
    assert "gloo" in registry.names("communicator")


def test_strict_makes_a_failing_plugin_fatal(plugin_dir):
    install_plugin(
        plugin_dir, "broken-dist", "broken", "broken_plugin", "import not_a_module_anywhere"
    )
    with pytest.raises(
        PluginError, match=r"plugin 'broken' \(broken_plugin\) failed to load: ModuleNotFoundError"
    ):
        Registry.load(strict=True)


def test_two_plugins_claiming_one_name_is_an_error_naming_both(plugin_dir):
    install_plugin(
        plugin_dir, "first-dist", "first", "first_plugin", COMMUNICATOR_PLUGIN.format(name="gloo")
    )
    with pytest.raises(PluginError) as error:
        Registry.load()
    assert "communicator 'gloo' is provided by two plugins" in str(error.value)
    assert "'first'" in str(error.value) and "'gloo'" in str(error.value)


def test_allow_list_loads_only_named_plugins(plugin_dir):
    install_plugin(
        plugin_dir, "broken-dist", "broken", "broken_plugin", "raise RuntimeError('boom')"
    )
    install_plugin(
        plugin_dir, "extra-dist", "extra", "extra_plugin", COMMUNICATOR_PLUGIN.format(name="extra")
    )
    registry = Registry.load(allow=["gloo"])
    assert registry.names("communicator") == ["gloo"]
    assert registry.failures == []  # the broken plugin was never imported
    assert {"broken", "extra"} <= set(registry.skipped)
    assert "gloo" not in registry.skipped


def test_allow_list_naming_an_unknown_plugin_is_an_error():
    with pytest.raises(PluginError, match=r"SHARDLINE_PLUGINS names 'nope'.*installed: .*gloo"):
        Registry.load(allow=["gloo", "nope"])


def test_unknown_name_suggests_the_close_one_and_lists_allowed():
    with pytest.raises(ConfigError) as error:
        Registry.load().get("communicator", "glo", field="parallel.communicator")
    message = str(error.value)
    assert "parallel.communicator = 'glo'" in message
    assert "did you mean 'gloo'?" in message
    allowed = message.split("Allowed: ", 1)[1]
    assert "gloo" in allowed and "mpi" in allowed and "package.module:Class" in allowed


def test_import_path_selects_a_class_directly():
    component = Registry.load().get("communicator", "shardline_gloo.communicator:GlooBackend")
    assert component.plugin == "(import path)"
    assert component.capabilities.async_p2p is True
    with pytest.raises(ConfigError, match="cannot import it"):
        Registry.load().get("communicator", "no_such_module:Backend")


def test_unavailable_component_raises_the_typed_error(plugin_dir):
    install_plugin(
        plugin_dir,
        "ghost-dist",
        "ghost",
        "ghost_plugin",
        """
        from shardline.interfaces import CommunicatorBackend
        from shardline.registry import Component, hookimpl

        class GhostBackend(CommunicatorBackend):
            @classmethod
            def unavailable_reason(cls):
                return "needs 8 CUDA devices, found 0"

        @hookimpl
        def shardline_communicators():
            return [Component(name="ghost", target="ghost_plugin:GhostBackend")]
        """,
    )
    component = Registry.load().get("communicator", "ghost")
    assert component.unavailable_reason() == "needs 8 CUDA devices, found 0"
    with pytest.raises(
        BackendUnavailableError, match="communicator 'ghost' cannot run here: needs 8 CUDA"
    ):
        component.load_available()
