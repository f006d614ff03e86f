"""A directory replica: its hot calls, checked (`service.py`), its election among replicas
(`leader.py`), and the leader's periodic round (`reaper.py`)."""
