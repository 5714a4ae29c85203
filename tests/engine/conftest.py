"""Engine tests run torch on one thread.

NOTE: on a busy 2-core machine torch's second thread makes every small op wait for a time
slice (a SmolLM2 decode step measured 3.5 s with 2 threads, 0.1 s with 1). The setting is
restored after each module so other test directories keep the default.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
