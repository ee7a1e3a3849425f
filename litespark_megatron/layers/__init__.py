"""The Litespark modules: the attention, MLP and norm that the Litespark layer spec plugs into TransformerLayer."""
from .attention import LitesparkCoreAttention, LitesparkSelfAttention
from .mlp import LitesparkMLP
from .norm import LitesparkRMSNorm

__all__ = ["LitesparkCoreAttention", "LitesparkSelfAttention", "LitesparkMLP", "LitesparkRMSNorm"]
