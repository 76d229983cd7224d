"""Algorithms: torch modules with per-unit losses (or closed-form per-unit directions); they never add noise.

``base`` holds the contract every algorithm declares (``PrivateAlgorithm``: loss form, batch keys, policy kind,
privacy unit); ``registry`` the algorithms that learn a policy from logged data (``register_algorithm``), which the
``train`` pipeline, the ``dporl`` command, the Python API, the config audit and the policy export read.
"""
