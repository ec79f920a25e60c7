"""One parser per tool: raw text -> facts. Pure; garbage yields unknown, never raises."""
