"""The gloo communicator: raw ``ProcessGroupGloo`` objects, one per group, no torch globals
(the shared machinery is :class:`~shardline.comm.process_group.ProcessGroupCommunicator`)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from typing import Any

import torch.distributed as dist

from shardline.interfaces import CommunicatorBackend, Rendezvous
from shardline.sdk import ProcessGroupCommunicator, connect_store
from shardline_gloo.plugin import GLOO_CAPABILITIES


class GlooBackend(CommunicatorBackend):
    """Creates gloo worlds. Every group honours the timeout it was created with."""

    name = "gloo"
    capabilities = GLOO_CAPABILITIES

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not dist.is_available() or not dist.is_gloo_available():
            return "this torch build has no gloo support (torch.distributed.is_gloo_available())"
        return None

    def init_world(
        self, rank: int, world_size: int, rendezvous: Rendezvous, timeout_s: float
    ) -> GlooCommunicator:
        join_timeout_s = rendezvous.join_timeout(timeout_s)
        store = connect_store(rendezvous.with_prefix("gloo"), join_timeout_s)
        # One transport device (one I/O thread) serves the world and all its subgroups.
        device = _gloo_device(rendezvous.host, rendezvous.port)
        return GlooCommunicator.create(
            store, device, rank, world_size, timeout_s, "w/", join_timeout_s
        )


class GlooCommunicator(ProcessGroupCommunicator):
    """One ``ProcessGroupGloo``; ``transport`` is the world's gloo device (one I/O thread)."""

    backend_name = "gloo"
    backend_capabilities = GLOO_CAPABILITIES

    @classmethod
    def new_process_group(
        cls, store: dist.Store, transport: Any, rank: int, world_size: int, timeout_s: float
    ) -> dist.ProcessGroupGloo:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        options._devices = [transport]
        return dist.ProcessGroupGloo(store, rank, world_size, options)


def _gloo_device(host: str, port: int):
    """gloo's transport device: on ``GLOO_SOCKET_IFNAME``'s interface when set; otherwise on
    the address this host reaches the rendezvous store from (loopback for a world of one
    host), never guessed from the host name, which may resolve to nothing routable."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    return dist.ProcessGroupGloo.create_device(hostname=local_address_towards(host, port))


def local_address_towards(host: str, port: int) -> str:
    """The address of this host that packets to ``host`` leave from (a route lookup: a UDP
    socket is connected, nothing is sent)."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        if host == "localhost":
            return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]
