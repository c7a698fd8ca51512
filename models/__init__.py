"""Models for jax-flash experiments."""
from models.gpt2 import (  # noqa: F401
    GPT, GPTConfig, AttentionSpec, ATTENTION_FNS, attend, count_params, cross_entropy,
    per_head_weights, register_attention, standard_attention,
)
