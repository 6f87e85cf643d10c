"""Kernel-parameter structs as the launchers pack them, checked against their C++ definitions.

Every kernel takes one `__grid_constant__` struct. A `ParamsStruct` lists its fields in C++
declaration order; `pack` lays the values out by the C++ rules (each field at the next multiple
of its alignment, the size rounded up to the largest one), and `static_asserts` gives the lines
the JIT adds to the kernel's source, so that a launcher and a header that disagree fail to
compile instead of corrupting a launch.
"""
from __future__ import annotations

import struct
from typing import Sequence

# field kind -> (size, alignment, struct format)
_KINDS = {
    "tensor_map": (128, 128, None),  # CUtensorMap: 128 opaque bytes, alignas(128) in CUDA 13's cuda.h
    "ptr": (8, 8, "<Q"),
    "u32": (4, 4, "<I"),
}


class ParamsStruct:
    """The C++ struct `cpp_name` (qualified, e.g. ``deep_gemm::MGroupedGemmParams``) with
    `fields`, ``(name, kind)`` pairs in declaration order; kind is "tensor_map" (bytes of an
    encoded CUtensorMap), "ptr" (an address, 0 for null) or "u32"."""

    def __init__(self, cpp_name: str, fields: Sequence[tuple[str, str]]):
        self.cpp_name = cpp_name
        self.offsets: dict[str, int] = {}
        self.kinds = dict(fields)
        offset, align = 0, 1
        for name, kind in fields:
            size, field_align, _ = _KINDS[kind]
            offset = -(-offset // field_align) * field_align
            self.offsets[name] = offset
            offset += size
            align = max(align, field_align)
        self.size = -(-offset // align) * align

    def pack(self, **values) -> bytes:
        """The struct's bytes; every field must be given, by name."""
        missing, unknown = self.offsets.keys() - values.keys(), values.keys() - self.offsets.keys()
        if missing or unknown:
            raise TypeError(f"{self.cpp_name}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
        data = bytearray(self.size)
        for name, offset in self.offsets.items():
            value, kind = values[name], self.kinds[name]
            if kind == "tensor_map":
                if len(value) != 128:
                    raise ValueError(f"{self.cpp_name}.{name}: a tensor map is 128 bytes, got {len(value)}")
                data[offset:offset + 128] = value
            else:
                struct.pack_into(_KINDS[kind][2], data, offset, value)
        return bytes(data)

    def static_asserts(self) -> str:
        """C++ lines checking the struct's size and every field's offset (needs <cstddef>)."""
        t = self.cpp_name
        lines = [f'static_assert(sizeof({t}) == {self.size}, "{t}: the launcher packs {self.size} bytes");']
        lines += [f'static_assert(offsetof({t}, {name}) == {offset}, "{t}::{name}: the launcher packs it at {offset}");'
                  for name, offset in self.offsets.items()]
        return "\n".join(lines)
