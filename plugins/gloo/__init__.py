"""Shardline's gloo communicator: torch.distributed's gloo backend on CPU tensors."""
