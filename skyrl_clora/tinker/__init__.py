"""The Tinker API on skyrl-clora: SkyRL 0.4's own Tinker server (``skyrl.tinker.api``) with the embedded engine and
trainer as its backend (``server``: the command; ``engine_main``: the engine process it starts)."""
