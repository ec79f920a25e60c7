"""The export's error type: what went wrong, and the command or change that fixes it."""

from __future__ import annotations

from unsloth.errors import UnslothError


class ExportError(UnslothError):
    pass
