"""Parallelism from torch, applied to one rank's part of the model: ranks and meshes (``dims``), tensor-parallel
plans (``tp_plan``), activation checkpointing, the order they are applied in with compile and FSDP2
(``parallelize``, ``fsdp``), pipeline stages and schedules (``pipeline``), and the element ranges a rank holds
(``placement``)."""
