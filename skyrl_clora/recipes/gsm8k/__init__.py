"""GSM8K-format agentic task: generated word problems, real GSM8K parquet loading, the calculator env."""

from skyrl_clora.recipes.gsm8k.env import GSM8KCalcEnv, register_gsm8k_env
from skyrl_clora.recipes.gsm8k.problems import (
    DATA_SOURCE,
    ENV_CLASS,
    SYSTEM_PROMPT,
    VARIANTS,
    Problem,
    generate_problems,
    load_gsm8k_parquet,
    make_dataset_rows,
    save_rows_parquet,
)

__all__ = [
    "DATA_SOURCE",
    "ENV_CLASS",
    "GSM8KCalcEnv",
    "Problem",
    "SYSTEM_PROMPT",
    "VARIANTS",
    "generate_problems",
    "load_gsm8k_parquet",
    "make_dataset_rows",
    "register_gsm8k_env",
    "save_rows_parquet",
]
