"""SpecError: the one error a spec value, a mod expression or a spec file raises. It imports nothing, and it lives
outside fagen/spec/ so that fagen.mods (which fagen.spec.kernel imports) can raise it without running
fagen/spec/__init__.py first."""

from __future__ import annotations

from typing import Any


class SpecError(ValueError):
    """A spec value is invalid. Carries the field, the value given and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}: got {value!r}; {allowed}")
