"""transformers, as the tests' reference, reading a GGUF file in a third of the time.

transformers reads a GGUF file with the gguf package twice (config, then weights). Its reader
parses every metadata value through slices of a ``numpy.memmap``, whose ``__getitem__`` and
``__array_finalize__`` run in Python (SmolLM2's 49152 token strings and 48900 merges: ~9 s a
read here), and transformers builds gguf's tensor-name map once per module of the model (397
times for SmolLM2, ~30 ms each). :func:`quick_gguf_reading` makes the reader slice a plain
``ndarray`` over the same mapping and builds each name map once: the same bytes, the same
names, the same model (``tests/test_quick_gguf.py`` holds both ways equal).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import numpy as np


@contextlib.contextmanager
def quick_gguf_reading() -> Iterator[None]:
    """While inside, gguf's readers slice a plain ``ndarray`` view of their file's mapping
    (views of the same bytes, values unchanged) and ``gguf.get_tensor_name_map`` returns one
    map per (architecture, block count) (the map is only read)."""
    import gguf
    from gguf.gguf_reader import GGUFReader

    original_get = GGUFReader._get
    original_name_map = gguf.get_tensor_name_map

    def plain_get(self, offset, dtype, count=1, override_order=None):
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)  # keeps the mapping alive as its base
        return original_get(self, offset, dtype, count, override_order)

    GGUFReader._get = plain_get
    gguf.get_tensor_name_map = functools.cache(original_name_map)
    try:
        yield
    finally:
        GGUFReader._get = original_get
        gguf.get_tensor_name_map = original_name_map
