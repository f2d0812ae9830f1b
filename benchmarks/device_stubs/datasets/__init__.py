"""An empty stand-in for Hugging Face ``datasets`` on the GPU machine, which lacks it (nothing can be installed
there beyond the carried wheels, and ``datasets`` needs pyarrow, over the carry limit).

SkyRL's ``skyrl.train.dataset`` package imports ``datasets`` at module level; the parts of it this project uses
(``_prompt_not_too_long``, ``compute_prompt_boundaries``, the worker utilities importing ``bin_packing``) never
call it. Only the GPU machine's command puts this folder on ``PYTHONPATH``
(``PYTHONPATH=/tmp/site:benchmarks/device_stubs``); anything reading an attribute of it raises ImportError.
"""


def __getattr__(name: str) -> object:
    raise ImportError(f"datasets.{name}: Hugging Face datasets is not installed on this machine "
                      "(benchmarks/device_stubs holds an empty stand-in)")
