"""How the trainer ranks share the work: the process group and device mesh (dist), context
parallelism (context_parallel), the torchrun entry point, and the fake GPU a dry run places the
model on (fake_gpu)."""
