"""Stand-in for the ``flash_attn`` package on machines without it (the H200 device machine, this CPU machine's
FSDP tests): SkyRL 0.4's FSDP model wrapper (``workers/model_wrapper.py``) imports ``flash_attn.bert_padding``'s
``pad_input``/``unpad_input`` at module level. Only that submodule exists here (plain torch index code); it has
no distribution metadata, so ``transformers.utils.is_flash_attn_2_available()`` stays False and flash attention
itself stays unavailable (run SkyRL with ``trainer.flash_attn=false trainer.remove_microbatch_padding=false``).
Put ``benchmarks/device_stubs`` on ``PYTHONPATH`` (after site-packages is fine) to use it; never install it.
"""
