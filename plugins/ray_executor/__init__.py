"""The ``ray`` executor plugin: one Ray actor per rank, in a placement group on a Ray cluster
(``pip install 'shardline[ray]'``; see :mod:`shardline_ray.executor`)."""
