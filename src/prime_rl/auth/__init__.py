"""How the run's processes know each other: the rendezvous store of the weight broadcast
(`store.py`), signed requests to the run's servers (`signing.py`)."""
