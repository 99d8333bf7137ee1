"""uvicorn's server with a drain: once told to stop, open requests get a grace period to
finish, and then end with an error of their own rather than be cancelled mid-response."""

from __future__ import annotations

import socket
from types import FrameType

import uvicorn

from shardline.serve.engine_loop import EngineLoop


class DrainingServer(uvicorn.Server):
    """Stops as uvicorn does (SIGTERM, Ctrl-C: no new connections, open ones closed once their
    response ends) and first drains ``engine``: new requests get 503, open ones get
    ``grace_s`` seconds and then a 503 error (a stream: an error event and ``[DONE]``). A
    second signal ends them at once, where uvicorn's own would cut them off mid-response. The
    config's ``timeout_graceful_shutdown`` must exceed ``grace_s`` by the engine's last step,
    or uvicorn cancels what is still open."""

    def __init__(self, engine: EngineLoop, grace_s: float, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._engine = engine
        self._grace_s = grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self._engine.drain(0.0)
        else:
            super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._engine.drain(self._grace_s)
        await super().shutdown(sockets)
