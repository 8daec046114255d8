"""What the bench measures besides the step time between barriers: the attention kernel's seconds
(``time_kernels``), tensor memory (``TensorMemory``) and the bytes sent to other ranks
(``CommBytes``), on any device.
"""

from __future__ import annotations

import time


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def time_kernels(device) -> list[float]:
    """Wrap the kernel entry points so the colocated path's attention seconds add up in the returned
    one-element list (the measured ideal needs them)."""
    from ... import kernels

    seconds = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            sync(device)
            start = time.perf_counter()
            result = fn(*a, **k)
            sync(device)
            seconds[0] += time.perf_counter() - start
            return result
        return wrapper

    kernels.varlen_attention_forward = timed(kernels.varlen_attention_forward)
    kernels.varlen_attention_backward = timed(kernels.varlen_attention_backward)
    return seconds


class TensorMemory:
    """Tensor bytes allocated inside the ``with`` block: ``live`` now and their ``peak``.

    A ``TorchDispatchMode`` sees every op; an output whose storage is new (not one of the op's
    inputs': views, in-place ops) is counted until the storage is freed. Tensors that existed before
    (weights, inputs) are not counted. Works on any device; allocator caching and fragmentation are
    not included (on CPU there is no allocator counter to read)."""

    def __enter__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self
        self.live = self.peak = 0
        sizes: dict[int, int] = {}

        def free(key):
            tracker.live -= sizes.pop(key)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if _is_tensor(t)}
                for t in tree_flatten(out)[0]:
                    storage = t.untyped_storage() if _is_tensor(t) else None
                    if storage is None or storage.nbytes() == 0 or storage.data_ptr() in inputs \
                            or storage.data_ptr() in sizes:
                        continue
                    sizes[storage.data_ptr()] = storage.nbytes()
                    tracker.live += storage.nbytes()
                    tracker.peak = max(tracker.peak, tracker.live)
                    weakref.finalize(storage, free, storage.data_ptr())
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _is_tensor(t) -> bool:
    import torch

    return isinstance(t, torch.Tensor)


class CommBytes:
    """Bytes this rank sends to other ranks through ``torch.distributed``'s all-to-all and
    all-gather calls inside the ``with`` block (distca, per-document CP and DeepSpeed all go
    through them): an all-to-all sends everything but its own split, an all-gather its input to
    every other rank."""

    NAMES = ("all_to_all_single", "all_gather", "all_gather_into_tensor")

    def __enter__(self):
        import inspect

        import torch.distributed as dist

        self.sent, self._saved = 0, {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self._saved.items():
            signature = inspect.signature(fn)

            def counting(*args, _fn=fn, _name=name, _signature=signature, **kwargs):
                self.sent += _bytes_sent(_name, _signature.bind(*args, **kwargs).arguments)
                return _fn(*args, **kwargs)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _bytes_sent(name: str, a: dict) -> int:
    import torch.distributed as dist

    group = a.get("group")
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if name == "all_to_all_single":
        rows = a["input"].shape[0] if a["input"].dim() else 0
        splits = a.get("input_split_sizes") or [rows // world] * world
        return (rows - splits[me]) * (a["input"].nbytes // max(rows, 1))
    sent = a["tensor"] if name == "all_gather" else a["input_tensor"]
    return (world - 1) * sent.nbytes
