import os

import hypothesis
import pytest

hypothesis.settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
hypothesis.settings.register_profile("dev", max_examples=30, deadline=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny models: as fast, and two threads on shared cores spend
    their time waiting. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_base_cache(request, tmp_path_factory, one_thread):
    """A cache directory holding the tiny base policy of the requesting module: its ``TINY_BASE`` (a
    :class:`~creditlab.train.toolshop_base.BaseConfig`), trained once per module, on one thread."""
    from creditlab.train.toolshop_base import base_policy

    path = tmp_path_factory.mktemp(f"{request.module.__name__}-cache")
    base_policy(request.module.TINY_BASE, cache_dir=path)
    return path


@pytest.fixture(scope="module")
def tiny_base(request, tiny_base_cache):
    """The requesting module's tiny base policy (its ``TINY_BASE``), loaded from :func:`tiny_base_cache`."""
    from creditlab.train.toolshop_base import base_policy

    return base_policy(request.module.TINY_BASE, cache_dir=tiny_base_cache)


class HostReads:
    """Counts device-to-host reads of tensor values (``item``, ``tolist``, ``bool``, ``float``, ``int``,
    ``numpy``...) made while ``with reads:`` is active; ``reads.calls`` lists them."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "__array__")

    def __init__(self):
        self.calls: list[str] = []

    def __enter__(self):
        import torch

        self._saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        self.calls.clear()

        def wrap(name, f):
            def counted(t, *args, **kwargs):
                self.calls.append(name)
                return f(t, *args, **kwargs)
            return counted

        for name, f in self._saved.items():
            setattr(torch.Tensor, name, wrap(name, f))
        return self

    def __exit__(self, *exc):
        import torch

        for name, f in self._saved.items():
            setattr(torch.Tensor, name, f)


@pytest.fixture
def host_reads():
    """A :class:`HostReads` counter: ``with host_reads: fn()`` then ``host_reads.calls``."""
    return HostReads()
