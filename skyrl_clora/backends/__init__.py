"""The tenant loop's backends: ``embedded`` (the project's own services) and ``skyrl`` (SkyRL's stack)."""
