"""The functions a shared library exports, read from its ELF dynamic symbol table (64-bit little-endian, as built
here): what the dynamic loader can resolve, not merely a name that appears somewhere in the file's bytes."""

from __future__ import annotations

import struct
from pathlib import Path

_SHT_DYNSYM = 11
_STT_FUNC = 2
_STB_GLOBAL, _STB_WEAK = 1, 2


def exported_functions(path: Path) -> set[str]:
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != _SHT_DYNSYM:
            continue
        strtab_offset = sections[link][4]
        for at in range(offset, offset + size, entsize):
            name_at, info, _, shndx, _, _ = struct.unpack_from("<IBBHQQ", data, at)
            if shndx == 0 or info & 0xF != _STT_FUNC or info >> 4 not in (_STB_GLOBAL, _STB_WEAK):
                continue  # undefined here (imported), or not an exported function
            end = data.index(b"\0", strtab_offset + name_at)
            names.add(data[strtab_offset + name_at:end].decode())
    return names
