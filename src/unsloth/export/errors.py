"""The one error type of the export: what went wrong, and the command or change that fixes it."""

from __future__ import annotations


class ExportError(Exception):
    def __init__(self, problem: str, fix: str | None = None):
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return self.problem if not self.fix else f"{self.problem}\n  fix: {self.fix}"
