"""jax-flash: flash attention for JAX with selectable numerics and the paper's stable softmax shift.

    import jax_flash
    o = jax_flash.attention(q, k, v, stable=True)        # [batch, seq, heads, head_dim]
"""

from .api import attention, attention_with_lse
from .policy import POLICIES, Policy, make_policy
from .reference import reference_attention, reference_numpy
from .rounding import round_to

__all__ = ["attention", "attention_with_lse", "reference_attention", "reference_numpy", "Policy",
           "make_policy", "POLICIES", "round_to"]
__version__ = "0.1.0"
