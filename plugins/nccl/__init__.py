"""Shardline's NCCL communicator (torch.distributed NCCL process groups)."""
