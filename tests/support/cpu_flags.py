"""What /proc/cpuinfo says of this CPU, for tests that check which C kernels it takes."""

from __future__ import annotations

import os

#: The flags the C kernels' AVX-512 set needs, and those their AVX2 set needs.
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl"})
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})


def vendor_family_flags() -> tuple[str, int, set[str]]:
    """The first processor's vendor, family and flags, as /proc/cpuinfo gives them."""
    fields: dict[str, str] = {}
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if not line.strip():
                break
            name, _, value = line.partition(":")
            fields[name.strip()] = value.strip()
    return fields["vendor_id"], int(fields["cpu family"]), set(fields["flags"].split())


def _flags() -> set[str]:
    return vendor_family_flags()[2] if os.path.exists("/proc/cpuinfo") else set()


def has_avx2_f16c() -> bool:
    """Whether this CPU runs the AVX2 kernels (AVX2, FMA, F16C)."""
    return _flags() >= AVX2_FLAGS


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 F, BW and VL (the C kernels' AVX-512 set)."""
    return _flags() >= AVX512_FLAGS
