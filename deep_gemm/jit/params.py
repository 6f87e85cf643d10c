"""Kernel-parameter structs as the launchers pack them, checked against their C++ definitions.

Every kernel takes one `__grid_constant__` struct. A `ParamsStruct` lists its fields in C++
declaration order; `pack` lays the values out by the C++ rules (each field at the next multiple
of its alignment, the size rounded up to the largest one), and `static_asserts` gives the lines
the JIT adds to the kernel's source, so that a launcher and a header that disagree fail to
compile instead of corrupting a launch.
"""
from __future__ import annotations

import operator
import struct
from typing import Sequence

# field kind -> (size, alignment, struct format)
_KINDS = {
    "tensor_map": (128, 128, "128s"),  # CUtensorMap: 128 opaque bytes, alignas(128) in CUDA 13's cuda.h
    "ptr": (8, 8, "Q"),
    "u32": (4, 4, "I"),
}


class ParamsStruct:
    """The C++ struct `cpp_name` (qualified, e.g. ``deep_gemm::MGroupedGemmParams``) with
    `fields`, ``(name, kind)`` pairs in declaration order; kind is "tensor_map" (bytes of an
    encoded CUtensorMap), "ptr" (an address, 0 for null) or "u32"."""

    def __init__(self, cpp_name: str, fields: Sequence[tuple[str, str]]):
        self.cpp_name = cpp_name
        self.offsets: dict[str, int] = {}
        self.kinds = dict(fields)
        offset, align, layout = 0, 1, "<"
        for name, kind in fields:
            size, field_align, code = _KINDS[kind]
            padded = -(-offset // field_align) * field_align
            layout += f"{padded - offset}x{code}" if padded > offset else code
            self.offsets[name] = offset = padded
            offset += size
            align = max(align, field_align)
        self.size = -(-offset // align) * align
        # One precompiled pack per launch: the launchers call `pack` on every GEMM.
        self._struct = struct.Struct(layout + (f"{self.size - offset}x" if self.size > offset else ""))
        assert self._struct.size == self.size
        names = list(self.offsets)
        self._fields_of = operator.itemgetter(*names) if len(names) > 1 else lambda values: (values[names[0]],)

    def pack(self, **values) -> bytes:
        """The struct's bytes; every field must be given, by name (tensor maps as the 128 bytes
        `deep_gemm.jit.tma` encodes)."""
        try:
            if len(values) != len(self.offsets):
                raise KeyError
            return self._struct.pack(*self._fields_of(values))
        except KeyError:
            missing, unknown = self.offsets.keys() - values.keys(), values.keys() - self.offsets.keys()
            raise TypeError(f"{self.cpp_name}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}") from None

    def static_asserts(self) -> str:
        """C++ lines checking the struct's size and every field's offset (needs <cstddef>)."""
        t = self.cpp_name
        lines = [f'static_assert(sizeof({t}) == {self.size}, "{t}: the launcher packs {self.size} bytes");']
        lines += [f'static_assert(offsetof({t}, {name}) == {offset}, "{t}::{name}: the launcher packs it at {offset}");'
                  for name, offset in self.offsets.items()]
        return "\n".join(lines)
