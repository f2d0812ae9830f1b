"""Multi-LoRA layers over a Hugging Face model, adapter initialisation and PEFT-format export."""
