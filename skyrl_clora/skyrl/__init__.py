"""SkyRL glue: the embedded engine behind SkyRL's HTTP inference protocol, per-tenant client views, the
translation of the plugin's Hydra config into SkyRL's ``SkyRLTrainConfig``, Ray policy workers over the
embedded trainer and the stack builder, for the ``backend=skyrl`` backend (``backends.skyrl``)."""

import importlib.util
import sys

import ray


def _give_skyrl_cloudpickle() -> None:
    """SkyRL 0.4's loss registries (``ppo_utils``) pickle functions for their Ray registry actors with
    ``cloudpickle``, falling back to plain ``pickle`` when that package is missing (it is not a dependency
    here). Plain pickle fails on them (in an actor, already while ``ppo_utils`` imports), so hand SkyRL the
    cloudpickle Ray ships, for imports to come and for a ``ppo_utils`` imported already."""
    if importlib.util.find_spec("cloudpickle") is not None:
        return
    sys.modules.setdefault("cloudpickle", ray.cloudpickle)
    ppo_utils = sys.modules.get("skyrl.backends.skyrl_train.utils.ppo_utils")
    if ppo_utils is not None:
        ppo_utils.cloudpickle = ray.cloudpickle


_give_skyrl_cloudpickle()
