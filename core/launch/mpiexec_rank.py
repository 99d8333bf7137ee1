"""A LocalWorld rank started by mpiexec: connect back to the parent, say this rank, receive
the world size, rendezvous and setup, then serve calls like a spawned rank.

    mpiexec -n N python -m shardline.launch.mpiexec_rank HOST:PORT
    (SHARDLINE_LOCAL_WORLD_AUTHKEY in the environment: the connection's key, hex)
"""

from __future__ import annotations

import multiprocessing.connection
import os
import sys

from shardline.launch.launcher_env import LaunchedRank
from shardline.launch.local_world import serve_rank
from shardline.launch.process_exit import skip_final_collection


def main(address: str) -> None:
    skip_final_collection()
    host, port = address.rsplit(":", 1)
    authkey = bytes.fromhex(os.environ["SHARDLINE_LOCAL_WORLD_AUTHKEY"])
    launched = LaunchedRank.from_environ(os.environ)
    connection = multiprocessing.connection.Client((host, int(port)), authkey=authkey)
    connection.send(launched.rank)
    world_size, rendezvous, setup = connection.recv()
    serve_rank(launched.rank, world_size, rendezvous, setup, connection)


if __name__ == "__main__":
    main(sys.argv[1])
