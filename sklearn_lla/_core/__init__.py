"""The contract every method builds on: pure torch / numpy, no network, no posterior.

* :mod:`.protocol`: ``FitData``, ``LatentPredictive``, the ``Posterior`` interface;
* :mod:`.likelihoods`: Gaussian, Categorical, Bernoulli and their link approximations;
* :mod:`.hyper`: the hyperparameter strategies (evidence, validation grid, EM, ...);
* :mod:`.optim`: the minibatch optimisation loop;
* :mod:`.linalg`: float64 Cholesky / eigh with escalating jitter;
* :mod:`.dask`: dask inputs, partition reduces;
* :mod:`.utils`: devices and seeding.
"""
