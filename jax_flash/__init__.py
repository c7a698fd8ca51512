"""jax-flash: flash attention for JAX with selectable numerics and the stable softmax shift of
Qiu & Yao (arXiv 2510.04212).

    import jax_flash
    o = jax_flash.attention(q, k, v, stable=True)        # [batch, seq, heads, head_dim]
    jax_flash.plan(q, k, v, stable=True)                 # what that computes, and how it runs
    o = jax_flash.dot_product_attention(q, k, v, mask=m, stable=True)   # jax.nn's arguments
"""

from .adapters import nnx_dot_product_attention
from .api import (attention, attention_qkvpacked, attention_with_lse, dot_product_attention,
                  dot_product_attention_plan, plan)
from .policy import POLICIES, Policy, make_policy
from .reference import reference_attention, reference_numpy
from .rounding import round_to
from .spec import Launch, Numerics, Plan

__all__ = ["attention", "attention_qkvpacked", "attention_with_lse", "plan", "dot_product_attention",
           "dot_product_attention_plan", "nnx_dot_product_attention", "Plan", "Numerics", "Launch",
           "reference_attention", "reference_numpy", "Policy", "make_policy", "POLICIES", "round_to"]
__version__ = "0.2.0"
