import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def small_chunks(monkeypatch):
    """Force many tiny column chunks so every chunked code path crosses chunk boundaries."""
    from fedtrust.aggregators import kernels

    monkeypatch.setattr(kernels, "CHUNK_BYTES", 64)
    monkeypatch.setattr(kernels, "SELECT_CHUNK_BYTES", 64)
