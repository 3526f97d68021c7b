"""Sweeps over many training runs.

``spec`` reads the sweep file, ``study`` keeps its Optuna study, ``trial``
runs one trial's Horovod job, ``sweep`` runs the trials and ``pages``
writes what the sweep found.
"""
