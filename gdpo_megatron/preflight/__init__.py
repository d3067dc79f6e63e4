"""What is checked before anything heavy is built: a command's inputs, this machine, the memory plan.

* :mod:`.validation`: config keys against each other, paths, data, reward files, the base
  model's files and shape, a run directory's checkpoints; nothing is written;
* :mod:`.doctor`: the installed stack against the pins, the GPU, NCCL, and the memory plan;
* :mod:`.plan`: per-GPU memory of a config on a cluster;
* :mod:`.pins`: the pinned library stack (``pins.txt``), read by setup.py and the Dockerfile too.
"""
