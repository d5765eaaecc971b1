"""Native model code for the dLLM families (see ddrl.models.native.base for the contract).

Each family module registers its backbone class in NATIVE_FAMILIES; importing this package
imports them all, so a lookup by family name finds every one.
"""

from ddrl.models.native import dream, llada, llada2, sdar, ursa  # noqa: F401  (register dream, llada, llada2, mmada, sdar, ursa)
from ddrl.models.native.base import NATIVE_FAMILIES, BackboneOutput

__all__ = ["NATIVE_FAMILIES", "BackboneOutput"]
