"""The GPU side below the backends: burstmpi's CUDA kernels and the GPU of each rank.

``kernels``: loading ``cuda/*.cu`` (NVRTC through CuPy), the kernels' configurations and
the ring's launches described as plain data; ``decode_launch``: the decode's two launches;
``kernelcheck``: the NVRTC compile check (``python -m burstmpi.kernelcheck``); ``device``: which GPU a rank uses, CuPy's import
with a clear error, and aborting the job on a device error. Imports CuPy only when asked.
"""
