"""litespark-megatron: Llama-style pretraining on Megatron-Core with Litespark attention and MLP."""
__version__ = "0.1.0"
