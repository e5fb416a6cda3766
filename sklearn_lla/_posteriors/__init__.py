"""All inference maths: the two shared engines and one module per method.

* :mod:`.glm`: the feature-space GLM posterior (exact LLA in parameter space, last
  layer, ELLA, subspace Laplace);
* :mod:`.gp`: the fixed-mean sparse variational GP (VaLLA, FMGP);
* :mod:`.exact`, :mod:`.ella`, :mod:`.valla`, :mod:`.fmgp`, :mod:`.sampled`,
  :mod:`.subspace`: each method's posterior;
* :mod:`.kernels`: the FMGP kernels.
"""
