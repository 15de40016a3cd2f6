"""dptrain's data-parallel training engine (pure torch.distributed; launched by torchrun)."""
