"""Wrapping the model: ``wrap()`` (wrap.py) hands it to torch's DistributedDataParallel, ddpkit's
``parallel.DataParallel``, FSDP (fsdp.py, with the ranks' agreed forward order over gloo in
forward_order.py) or, in a world of one, ``LocalEngine`` (local.py); its config (config.py), the
errors it raises (errors.py), mixed precision (precision.py), activation recomputation with the
same draws (recompute.py), the checks that every rank built the same model (models.py), and a
meta model's values at setup from a weights file or its own initialization (materialize.py, which
reads the file through weights_source.py), and rank 0's buffers given to every rank before a
checkpoint, as before a forward (buffers.py).
"""
