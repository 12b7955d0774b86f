"""What every process of a run uses to run, whichever process it is: its start (`entry`), its stop
on a signal (`shutdown`), its log lines (`logging_setup`) and metrics (`monitor`), its activity record
for the watchdog (`activity`), the output folder the processes share (`layout`) and a full disk
there (`disk`), the run secret (`secret`), one TLS context (`tls`) and free ports (`net`).

Invariant: reaches no process package (tests/unit/layering_test.py), and this package runs no code
of its own, so that a config importing one of its light modules (`monitor`'s `WandbConfig`) loads
nothing else.
"""
