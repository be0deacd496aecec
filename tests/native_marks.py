"""Skip marker for tests of the C kernels: they need a working C compiler (CI machines have gcc;
without one the engine falls back to torch, which the other tests cover)."""

import pytest

from batchserve.kernels import native

requires_native_kernels = pytest.mark.skipif(not native.available(), reason="no C compiler: C kernels not built")
