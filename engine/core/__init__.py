"""The control plane: configs, sequences, the block manager and the scheduler, shared by the engine and the
simulator. Torch-free and simulator-free; under 1,000 lines (tests/control_plane/test_no_torch.py)."""
