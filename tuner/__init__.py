"""tsdecode's tuner: shape grids, measurement, Optuna search, tables and reports.

Imports the runtime (``tsdecode``); the runtime never imports this package.
"""
