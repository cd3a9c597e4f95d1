"""gradcomm inside other programs: each module adapts one framework's entry point.

- :mod:`.ddp`: the PyTorch DDP communication hook (``make_comm_hook``);
- :mod:`.fsdp`: FSDP2's compressed reduce-scatter (``compress_fsdp``);
- :mod:`.mpi`: ``wrap(comm)``, an mpi4py communicator whose ``Allreduce`` is gradcomm's;
- :mod:`.decentralized`: decentralized SGD (gossip over a topology, ``DecentralizedSGD``);
- :mod:`.onebit_adam`: the 1-bit Adam optimizer and its DDP hook (``OneBitAdam``).

Nothing here is imported with ``gradcomm``; each module imports its framework lazily.

Example:
    >>> import importlib.util
    >>> all(importlib.util.find_spec(f"gradcomm.integrations.{m}") is not None
    ...     for m in ("ddp", "fsdp", "mpi", "decentralized", "onebit_adam"))
    True
"""
