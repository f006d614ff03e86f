"""The directory's process: its composition root (`build.py`) and its ASGI app, election thread and
background thread (`app.py`)."""
