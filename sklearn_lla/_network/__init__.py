"""Everything that touches the user's ``nn.Module``.

* :mod:`.resolve`: the ``net`` parameter, the default MLP, skorch training;
* :mod:`.linearized`: ``LinearizedNet``, ``g(x)``, JVPs, VJPs, Jacobians, NTK blocks;
* :mod:`.backends`: the Jacobian-backend interface and its implementations (chosen once
  per ``LinearizedNet``);
* :mod:`.structured`: the structured fast path for chains of ``nn.Linear`` layers;
* :mod:`.penultimate`: penultimate-layer features;
* :mod:`.curvature`: KFAC, the GGN and its diagonal, SWAG variances.
"""
