"""Hyperparameter sweeps: trials as ordinary jobs, sampled and pruned by Optuna."""
