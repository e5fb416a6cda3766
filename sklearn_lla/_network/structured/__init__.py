"""Structured NTK, JVP and VJP for chains of ``nn.Linear`` layers and elementwise maps.

* :mod:`.trace`: recognising a chain (``ChainSpec``);
* :mod:`.jacobian`: factored Jacobians (``StructuredJacobian``);
* :mod:`.chain`: ``StructuredChain``, the forward/backward passes.
"""
