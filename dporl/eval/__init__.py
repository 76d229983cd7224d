"""Evaluation: returns in a simulator with confidence intervals, OPE metrics, private OPE on logged data, coverage
studies where the truth is exact."""
