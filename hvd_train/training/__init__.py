"""One training run: ``run.run`` and the stages, loop and outputs it is made of (see ``run``)."""
