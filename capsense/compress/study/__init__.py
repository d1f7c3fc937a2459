"""Studies over compression settings: resumable grids, fitted predictors, budgeted selection, reports."""
