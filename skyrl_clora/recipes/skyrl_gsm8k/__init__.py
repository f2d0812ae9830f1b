"""SkyRL's own GSM8K recipe: skyrl-gym's single-turn ``gsm8k`` env on SkyRL-format GSM8K rows."""
