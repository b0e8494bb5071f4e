"""Single-pass manifold-constrained hyper-connections (mHC): `hc_mult` residual streams per token. The math and
its device choice are ops (`kernels/mhc.py`); these names are kept here for the modules that import them."""

from ..kernels.mhc import HyperMix, MixWeights, hc_collapse, hc_expand, hc_mixes, initial_streams, split_sinkhorn

__all__ = ["HyperMix", "MixWeights", "hc_collapse", "hc_expand", "hc_mixes", "initial_streams", "split_sinkhorn"]
