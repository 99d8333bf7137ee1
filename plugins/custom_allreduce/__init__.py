"""Shardline's shared-memory all-reduce, layered over another communicator."""
