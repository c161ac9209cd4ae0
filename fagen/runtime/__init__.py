"""Runtime: module import, load, prebuilt cubins, the CUDA driver and nvcc command, device choice, fagen.attention."""
