"""The executor conformance suite: one contract for every executor, built-in or third-party.

Run it with ``shardline conformance NAME`` (NAME an executor) or
``pytest --pyargs shardline.conformance.executors --shardline-executor=NAME``.
"""
