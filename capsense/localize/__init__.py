"""Localization: knockout designs, sparse solvers, methods, measure-and-choose, the run folder and its outputs."""
