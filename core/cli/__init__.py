"""The ``shardline`` command line."""
