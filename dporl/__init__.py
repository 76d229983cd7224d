"""dporl: differentially private offline reinforcement learning in PyTorch.

Layers, each importing only the ones before it:
utils -> data, envs, experts -> privacy -> algos -> train -> eval, logging -> pipelines (CLIs).
"""

__version__ = "0.1.0"
