"""A ``DataLoader`` fetches its batches with optamp's rules off, in any process.

Casting is on for the thread that called ``initialize``, and a worker process started by fork
inherits that thread's state: a dataset's transforms were cast there (a ``torch.mm`` returned
fp16, a mel spectrogram's filterbank matmul too, whose powers above 65504 became inf), while
workers started by spawn (the default on macOS and Windows, or ``multiprocessing_context=
"spawn"``) start without it and did not cast, and with ``num_workers=0`` the training thread
itself ran the transforms, cast. The same program gave different data by platform. Native
autocast programs load their data outside their autocast regions, so their transforms run in
fp32 everywhere; that is what a ``DataLoader`` gives now: the fetch of each batch (the dataset's
``__getitem__`` / ``__iter__`` and the collate function) runs inside ``disable_casts``, in the
training thread and in workers alike. A dataset that wants reduced precision enters
``optamp.autocast()`` itself.

The fetchers are torch's private ``torch.utils.data._utils.fetch`` classes, the one place every
batch of every ``DataLoader`` passes through; where they are missing nothing is wrapped.
"""
from ._wrapping import replace, rules_off


def install() -> None:
    """Idempotent."""
    try:
        from torch.utils.data._utils import fetch as fetchers
    except ImportError:
        return
    for name in ("_MapDatasetFetcher", "_IterableDatasetFetcher"):
        cls = getattr(fetchers, name, None)
        if cls is not None:
            replace(cls, "fetch", rules_off)
