"""SkyRL glue: the embedded engine behind SkyRL's HTTP inference protocol, per-tenant client views and
the translation of the plugin's Hydra config into SkyRL's ``SkyRLTrainConfig``."""
