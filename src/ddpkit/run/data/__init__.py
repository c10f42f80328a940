"""The loop's data: the ``Loader`` the user's loop iterates and the source made from the user's
data (loader.py); what ``run.loader`` is handed, checked (loader_checks.py), and a user's
DataLoader's settings, carried over or refused (from_dataloader.py); the two kinds of source, a
map-style dataset over the global batch sampler's plan (map_source.py) and iterable streams
(stream.py); and ``run.evaluate``'s pass over a held-out set (evaluate.py).
"""
