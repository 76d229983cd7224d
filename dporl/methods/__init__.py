"""Methods: how a run combines privacy mechanisms with an algorithm, as objects (one spelling for each).

A method is a bundle: which private stages it runs and their budgets (functions of the run's epsilon, delta and
shares), what its training stage samples (its batch source), whether it needs the experts that logged the data and
a public simulator, whether its training stage takes what the earlier stages leave of the run budget, and the label
its results carry. ``dporl.methods.unit_level`` holds the methods of the ``train`` pipeline (the expert-level
paper's Algorithms 1-4 over any privacy unit); ``dporl.methods.reward_level`` those of reward-level Q-learning (the
``fnq`` pipeline). Names are looked up with ``method_named``: an unknown or differently spelled name is a
ValidationError that lists the known ones and, for a spelling that differs only in underscores or case, names the
right one.

Layering: methods combine the privacy layer (events, samplers, the count) with algorithms (their batch keys), and
are used by the pipelines and the audits; they import neither.
"""
