"""jax-flash: flash attention for JAX with selectable numerics and the stable softmax shift of
Qiu & Yao (arXiv 2510.04212).

    import jax_flash
    o = jax_flash.attention(q, k, v, stable=True)        # [batch, seq, heads, head_dim]
    jax_flash.plan(q, k, v, stable=True)                 # what that computes, and how it runs
"""

from .api import attention, attention_with_lse, plan
from .policy import POLICIES, Policy, make_policy
from .reference import reference_attention, reference_numpy
from .rounding import round_to
from .spec import Launch, Numerics, Plan

__all__ = ["attention", "attention_with_lse", "plan", "Plan", "Numerics", "Launch",
           "reference_attention", "reference_numpy", "Policy", "make_policy", "POLICIES", "round_to"]
__version__ = "0.2.0"
