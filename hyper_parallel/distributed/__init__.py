"""The ground floor: torch.distributed and autograd adapters (see docs/design.md)."""
