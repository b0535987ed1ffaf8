"""Timing shared by the benchmark scripts: contenders run in turn, in a rotating order.

The one implementation lives in the library, where the backend's calibration times its kernels the same way.
"""

from aiayn.backends.timing import interleaved

__all__ = ["interleaved"]
