"""The same update on any world size: what a sample draws is keyed by the sample, not by the rank
or the process count. The keyed generator (keyed.py), ``run.randn_like`` and friends (draws.py),
dropout modules keyed per sample (dropout.py), ``F.dropout`` and attention's ``dropout_p`` inside a
forward (functional_dropout.py), and ``run.all_gather``'s rows of every rank with their gradients
(gather.py). Nothing here knows the engine, the checkpoint or the step cycle.
"""
