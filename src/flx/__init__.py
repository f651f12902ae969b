"""flx: federated learning on PyTorch Lightning."""
