"""The environment self-test: one script, one parser, one judge.

- :mod:`unsloth.selftest.script` is a standard-library-only script run by an environment's own Python
  (it must report, not crash, when torch is broken); it prints one JSON line per check.
- :mod:`unsloth.selftest.run` runs it there, from a clean folder, with a timeout (the one side effect).
- :mod:`unsloth.selftest.parse` reads its lines.
- :mod:`unsloth.selftest.judge` turns them, with the plan, into findings.

It sits below both ``unsloth.envs`` (an install verifies the environment it built) and
``unsloth.doctor`` (which checks it again later), so neither imports the other.
"""
