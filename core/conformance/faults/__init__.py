"""The fault-injection suite: each scenario plants one fault in a real world (an executor,
a communicator, real processes) and checks that every surviving process raises a typed
error within the deadline + 1 s, that shutdown is clean, and that no process and no
``/dev/shm`` entry is left. ``shardline faults`` runs the matrix (see :mod:`.matrix`).
"""
