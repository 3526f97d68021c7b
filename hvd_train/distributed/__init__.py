"""Horovod's part of hvd_train: the only package that imports ``horovod.tensorflow``.

* ``context``: ``Context`` (rank, size) and its collectives; every other layer
  receives one and so also runs as a single process.
* ``start``: the launch checks and ``init`` (Horovod, GPUs, CPU threads).
* ``gradients``: the distributed optimizer, broadcast and averaging of weights.
* ``elastic``: the retry loop of an elastic job (``hvd_train.training.elastic``
  says what is kept and rolled back).
* ``exits``: ending a rank without hanging the others.
* ``hostname``, ``cpus``, ``memory``: what a rank finds on its host before Horovod starts.
* ``launchers``: the launchers known, an entry each (their variables, MPI or
  elastic, stop signal, a sweep trial's command); only the standard library.

Outside this package, ``hvd_train.commands.launch`` runs Horovod's launcher (its
runner, not the ranks' library) and ``doctor`` reads Horovod's build flags.
Importing this package imports nothing: the command line reads ``hostname``
before TensorFlow loads.
"""
