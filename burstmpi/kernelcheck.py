"""``python -m burstmpi.kernelcheck [ARCH ...]``: the NVRTC compile check of cuda/.

The command's stable name; the check itself is ``burstmpi._gpu.kernelcheck``.
"""

from ._gpu.kernelcheck import main

if __name__ == "__main__":
    raise SystemExit(main())
