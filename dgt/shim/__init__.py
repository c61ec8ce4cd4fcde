"""Drop-in for PyTorch: DDP communication hook and a torch.distributed backend."""
