"""Shardline: transformer inference across ranks, with every moving part chosen from config.

The import package is light on purpose: importing ``shardline`` does not import torch or any
plugin. Public pieces live in sub-packages (``shardline.interfaces`` for the contracts,
``shardline.distributed`` for groups and layout, ``shardline.registry`` for plugins,
``shardline.config`` for configuration, ``shardline.conformance`` for the suite).
"""

__version__ = "0.1.0"
