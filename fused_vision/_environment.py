"""fused_vision's environment switches, every one read through these two parsers (docs/environment.md).

A switch that is unset or empty takes its default. Values are read without surrounding spaces and in any
case; anything else is a ValueError naming the variable and the values it takes, never a silent default.
"""

import os

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def _read(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def flag(name: str, default: bool | None = False) -> bool | None:
    """An on/off switch: True for 1, true, yes or on; False for 0, false, no or off; unset, ``default``."""
    value = _read(name)
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(ON + OFF)} (or unset)")


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """A switch of named values: one of ``choices``; unset, ``default``."""
    value = _read(name)
    if not value:
        return default
    if value not in choices:
        raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(choices)} (or unset)")
    return value
