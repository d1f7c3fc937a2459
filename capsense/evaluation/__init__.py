"""Measuring with stock lm-eval: the ``capsense-masked`` model, its registration hook, evaluate, validate, recipes.

Kept import-free: the lm-eval start-up hook imports a module of this package at every Python start-up.
"""
