"""The tenant loop's backends: ``embedded`` (the project's own services); SkyRL's stack is ``skyrl.driver``."""
