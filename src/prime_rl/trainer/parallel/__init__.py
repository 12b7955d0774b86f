"""How the trainer ranks share the work: the process group and device mesh (dist), context
parallelism (context_parallel) and the torchrun entry point."""
