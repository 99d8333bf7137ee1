"""Tensor-parallel layers. Each takes its TP group in the constructor; the sharding math is
the pure functions of :mod:`shardline.layers.sharding`."""
