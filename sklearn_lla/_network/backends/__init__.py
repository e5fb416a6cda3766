"""Jacobian backends: who computes ``LinearizedNet``'s products (chosen once, at construction).

* :mod:`.base`: the interface (:class:`~.base.JacobianBackend`, generic ``torch.func``
  products) and dense Jacobian rows;
* :mod:`.chain`: chains of ``nn.Linear`` layers and elementwise maps;
* :mod:`.graph`: networks whose linearised layers are ``nn.Linear``, ``nn.Conv1d`` /
  ``nn.Conv2d`` and eval-mode BatchNorm, any graph between them (residual additions,
  pooling, ...);
* :mod:`.select`: which of them a network gets, and the same choice after unpickling.
"""
