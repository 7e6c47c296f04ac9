"""What the library and the command line say alike about options: the precisions a prefill runs in (`DTYPES`), the
range of a seed (`MAX_SEED`), and `OptionError`, one message that names an option as the Python API spells it
(`prefill_chunk`) or as the command line does (`--prefill-chunk`), so that a check lives next to what it checks and
both hear it in their own words."""

from __future__ import annotations

import re
from collections.abc import Callable

DTYPES = ("bfloat16", "float32")
MAX_SEED = 2**32 - 1  # jax.random.key and numpy's generators both take it

_NAME = re.compile(r"\$(\$|[a-z_]+)")  # $name, or $$: a literal $ (see `literal`)


def literal(text) -> str:
    """`text` (a path, another error's message) as it goes into an OptionError's message: every $ kept as it is,
    not read as an option's name."""
    return str(text).replace("$", "$$")


class OptionError(ValueError):
    """A value out of range, or options that do not combine. The message marks each option it names as $name:
    str(e) spells it as the Python API does (the name itself, or the spelling given as a keyword, e.g.
    scan="mode 'scanned'"), `named(spell)` as spell(name) does (the command line: its flags)."""

    def __init__(self, message: str, **spelled: str):
        self.message, self.spelled = message, spelled
        super().__init__(self.named(lambda name: spelled.get(name, name)))

    def named(self, spell: Callable[[str], str]) -> str:
        return _NAME.sub(lambda m: "$" if m[1] == "$" else spell(m[1]), self.message)


def check_dtype(name: str, error: type[OptionError] = OptionError) -> str:
    """`name` if it is one of DTYPES, else `error` (an OptionError) naming the choices."""
    if name not in DTYPES:
        raise error(f"$dtype {name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return name
