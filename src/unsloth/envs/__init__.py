"""Managed environments: where they live, their receipts, the lock, and the transactional build.

Other parts of unsloth (doctor) use only :mod:`unsloth.envs.paths` and :mod:`unsloth.envs.receipt`:
``active_env()``, ``env_python(env)`` and ``read_receipt(env)``.
"""
