"""The HPO study: the engine loop, its planning service, the trial runners, the Optuna
study, checkpoints, the library entry, and the live view and reports.
"""
