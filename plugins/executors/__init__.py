"""Shardline's executors: how ranks are started and driven."""
