"""The one error type users see: what was wrong, and the command or setting that fixes it.

Every layer raises a subclass (config, matrix, export, build, ...); the CLI maps them to a message
and an exit code in one place.
"""

from __future__ import annotations


class UnslothError(Exception):
    def __init__(self, problem: str, fix: str | None = None):
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return self.problem if not self.fix else f"{self.problem}\n  fix: {self.fix}"
