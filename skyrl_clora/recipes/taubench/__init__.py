"""The tau-bench retail recipe's environment: data, tools, reward, simulated users and the skyrl-gym env.

``register_taubench_env()`` registers the ``taubench_retail`` environment in skyrl-gym; see
:class:`.env.TauBenchRetailEnv` for the settings an episode takes.
"""

from skyrl_clora.recipes.taubench.data import (
    Action,
    RetailData,
    Task,
    dataset_rows,
    load_retail_data,
    load_tasks,
)
from skyrl_clora.recipes.taubench.env import ENV_ID, TauBenchRetailEnv, register_taubench_env
from skyrl_clora.recipes.taubench.synthetic import make_synthetic_retail
from skyrl_clora.recipes.taubench.users import STOP_TOKEN, LLMUser, ScriptedUser, SimulatedUser

__all__ = [
    "ENV_ID",
    "STOP_TOKEN",
    "Action",
    "LLMUser",
    "RetailData",
    "ScriptedUser",
    "SimulatedUser",
    "Task",
    "TauBenchRetailEnv",
    "dataset_rows",
    "load_retail_data",
    "load_tasks",
    "make_synthetic_retail",
    "register_taubench_env",
]
