"""The embedded default base model: a tiny Qwen3 and its tokenizer, pre-trained and cached at first use."""

from skyrl_clora.tiny_base.pretrain import TinyBaseRecipe, ensure_tiny_base, tiny_base_path

__all__ = ["TinyBaseRecipe", "ensure_tiny_base", "tiny_base_path"]
