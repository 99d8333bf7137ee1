"""The communicator conformance suite: the Communicator contract, checked on real processes.

Run it on any registered communicator (built-in or a third party's)::

    pytest --pyargs shardline.conformance --shardline-communicator=NAME
    shardline conformance NAME

Options: ``--shardline-world-sizes=1,2,3,4``, ``--shardline-timeout=SECONDS`` (deadline of
each operation), ``--shardline-report=PATH`` (JSON: operation x dtype x world size ->
pass / fail / unsupported(reason)). Combinations outside the backend's declared capabilities
are skipped with the capability as the reason. One world of processes is started per world
size and reused by every test.
"""
