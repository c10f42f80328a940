"""The folder ``ddpkit run`` puts first on its workers' PYTHONPATH: only ``sitecustomize.py`` lives here."""
